"""Prompt log-probabilities (SamplingParams.prompt_logprobs) against HF transformers' forward of the same tiny model:
every prompt token's log-probability and top-k, across prompt chunks, beside a prefix-cache hit of the same prompt,
through preemption and lookahead, and with greedy output unchanged."""

from __future__ import annotations

import pytest
import torch

from orinfer import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = ["Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do",
           "Down, down, down. Would the fall never come to an end?"]
TOL = 2e-5  # fp32 on the CPU, two implementations of the same math


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """HF's log-softmax of each prompt's logits [len, vocab]."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False)
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = llm.tokenizer.encode(p)
            out[p] = (ids, torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1))
    return out


def _check(output, ids, logp, k):
    entries = output.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for t in range(1, len(ids)):
        e = entries[t]
        assert e.token_id == ids[t]
        assert abs(e.logprob - logp[t - 1, ids[t]].item()) < TOL
        want_lp, want_ids = logp[t - 1].topk(k)
        assert [i for i, _ in e.top] == want_ids.tolist()
        assert max((abs(v - w) for (_, v), w in zip(e.top, want_lp.tolist())), default=0.0) < TOL


@pytest.mark.parametrize("settings", [dict(max_num_batched_tokens=7), dict(max_num_batched_tokens=2048),
                                      dict(max_num_batched_tokens=6, async_scheduling=False),
                                      dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=8)])
def test_prompt_logprobs_match_hf(tiny_dir, reference, settings):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, **settings)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    plain = llm.generate(PROMPTS, greedy)  # also fills the prefix cache with both prompts
    params = [SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=k) for k in (3, 0)]
    outs = llm.generate(PROMPTS + PROMPTS[:1], params + [greedy])
    for out, k in zip(outs, (3, 0)):
        ids, logp = reference[out.prompt]
        _check(out, ids, logp, k)
        assert out.num_cached_tokens == 0  # computed, not read from the cache
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] + [plain[0].token_ids]
    assert outs[2].prompt_logprobs is None
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_preempted_sequence_keeps_one_entry_per_token(tiny_dir, reference):
    """A pool too small for all prompts: sequences are preempted and recomputed; no entry is doubled or lost."""
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, block_size=4, num_kv_blocks=14,
              max_num_batched_tokens=9)
    outs = llm.generate(PROMPTS * 2, SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=2))
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for out in outs:
        ids, logp = reference[out.prompt]
        _check(out, ids, logp, 2)


def test_prompt_logprobs_is_validated():
    with pytest.raises(Exception, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
