"""Speculative decoding: cheap proposals of the next few tokens, verified by the target model in one step.

config.py   the user's `speculative_config` (method, k, draft model, n-gram window, forced acceptance), validated
proposer.py the proposer of each method; draft_model.py a small model's greedy drafts; mtp.py the MTP head's drafts
drafter.py  the drafter's weight format ("quantization": "fp8": an FP8 MTP head or draft model, an FP8 LM head copy)
ngram.py    prompt lookup: the tokens that followed the latest earlier occurrence of the context's last n tokens
verify.py   the verify step's sampler: which drafts the target model accepts, and the token after them
"""
