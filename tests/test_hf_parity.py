"""orinfer (torch backend, fp32, CPU) against HF transformers on tiny random Qwen2 / Qwen3 models."""

from __future__ import annotations

import pytest
import torch

from hf_models import CONFIGS, build_hf_model, hf_greedy, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.engine.logits_probe import paged_logits  # noqa: F401 (other test files import it from here)

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99, 3, 150, 7, 8, 61], [11, 200, 14], [7] * 23 + [1, 2, 3], [88]]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    hf = build_hf_model(request.param)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, progress=False)
    return hf, llm


def test_logits_match_hf(pair):
    hf, llm = pair
    ids = PROMPTS[0] + PROMPTS[2]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = paged_logits(llm, ids, prefill_len=len(PROMPTS[0]))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_greedy_32_tokens_match_hf(pair):
    hf, llm = pair
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, PROMPTS[0], 32)
    assert out.finish_reason == "length"


def test_batched_prompts_match_alone(pair):
    """Continuous batching must not change any sequence's tokens: 4 prompts of different lengths together."""
    hf, llm = pair
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 32), f"prompt {prompt}"


def test_sharded_checkpoint_with_index(tmp_path):
    """A checkpoint split over several safetensors files with model.safetensors.index.json loads the same model."""
    hf = build_hf_model("qwen3-gqa4-untied")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    llm = LLM(tmp_path, dtype="float32", device="cpu", block_size=4, progress=False)
    ids = PROMPTS[0]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(paged_logits(llm, ids, prefill_len=len(ids)), expected, atol=1e-4, rtol=0)
