"""The checks every quantized format's model tests make: orinfer's torch backend (fp32, CPU) against HF transformers
running the same dequantised weights, and on the GPU the triton backend against the torch backend."""

from __future__ import annotations

import torch

from test_awq import hf_greedy_cached
from test_hf_parity import paged_logits
from orinfer import LLM, SamplingParams

PROMPT = [5, 17, 42, 99, 3, 150, 7, 8, 61]
SMALL_KV = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, progress=False)


def assert_matches_hf(model_dir, hf, steps: int = 16, llm: LLM | None = None) -> LLM:
    """Logits of a prefill + decode steps within 1e-3 of HF's, and `steps` greedy tokens identical. Returns the LLM
    (`llm`, or the torch backend's on the CPU)."""
    llm = llm or LLM(model_dir, **SMALL_KV)
    ids = PROMPT + [7] * 5 + [1, 2, 3]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = paged_logits(llm, ids, prefill_len=len(PROMPT))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-3
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    assert llm.generate([PROMPT], params)[0].token_ids == hf_greedy_cached(hf, PROMPT, steps)
    return llm


def assert_triton_matches_torch_on_cuda(model_dir, cuda_graph: bool) -> None:
    """fp32 on CUDA: the triton backend's greedy tokens are the torch backend's, for one sequence (decode at batch 1)
    and a batch of five."""
    common = dict(dtype="float32", device="cuda", num_kv_blocks=128, block_size=16, max_num_seqs=8, progress=False)
    tri = LLM(model_dir, backend="triton", cuda_graph=cuda_graph, **common)
    ref = LLM(model_dir, backend="torch", **common)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 3][: 2 + i] for i in range(5)]
    for batch in (prompts[:1], prompts):
        got = [o.token_ids for o in tri.generate(batch, params)]
        assert got == [o.token_ids for o in ref.generate(batch, params)]
