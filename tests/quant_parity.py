"""The check every quantized format's model test makes: orinfer's torch backend (fp32, CPU) against HF transformers
running the same dequantised weights."""

from __future__ import annotations

import torch

from test_awq import hf_greedy_cached
from test_hf_parity import paged_logits
from orinfer import LLM, SamplingParams

PROMPT = [5, 17, 42, 99, 3, 150, 7, 8, 61]
SMALL_KV = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, progress=False)


def assert_matches_hf(model_dir, hf, steps: int = 16) -> LLM:
    """Logits of a prefill + decode steps within 1e-3 of HF's, and `steps` greedy tokens identical. Returns the LLM."""
    llm = LLM(model_dir, **SMALL_KV)
    ids = PROMPT + [7] * 5 + [1, 2, 3]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = paged_logits(llm, ids, prefill_len=len(PROMPT))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-3
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    assert llm.generate([PROMPT], params)[0].token_ids == hf_greedy_cached(hf, PROMPT, steps)
    return llm
