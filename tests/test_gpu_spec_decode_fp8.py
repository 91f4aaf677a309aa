"""The FP8 drafter (speculative_config quantization "fp8", spec_decode/drafter.py) on the triton backend with CUDA
graphs: greedy tokens are plain decoding's (HF's) with MTP drafts (tiny Qwen3.5 dense and MoE targets with a random
head) and with a draft model (the trained tiny Qwen3, a perturbed copy drafting), fp32 and bf16; the proposals
replay their graphs, whose FP8 lm_head copy drafts what the eager path drafts (forced acceptance: equal tokens are
equal drafts)."""

from __future__ import annotations

import pytest
import torch

from orinfer import LLM, SamplingParams
from orinfer.layers.embedding import LinearHead
from test_mtp_graphs import count_proposals, mtp_target
from test_spec_decode import perturbed_dir  # noqa: F401  (a fixture)
from test_spec_decode_hybrid import MODELS, PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 40
LENGTHS = [STEPS, 17, 29]  # different lengths: the batch shrinks, so several buckets replay
MTP_FP8 = {"method": "mtp", "num_speculative_tokens": 3, "quantization": "fp8"}


@pytest.fixture(scope="module", params=sorted(MODELS))
def target(request, tmp_path_factory):
    return mtp_target(request.param, tmp_path_factory, PROMPTS, STEPS)


def engine(path, spec: dict | None, dtype: str = "float32", **settings) -> LLM:
    return LLM(path, dtype=dtype, device="cuda", backend="triton", block_size=16, kv_cache_bytes=64 << 20,
               max_num_seqs=8, max_num_batched_tokens=64, progress=False, speculative_config=spec, **settings)


def tokens(llm: LLM, prompts, seed: int | None = None) -> list[list[int]]:
    if seed is not None:
        torch.manual_seed(seed)  # forced acceptance draws its uniforms from the global generator
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in LENGTHS[:len(prompts)]]
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_mtp_fp8_drafts_keep_greedy_tokens_through_the_graphs(target):
    path, want = target
    llm = engine(path, MTP_FP8)
    assert isinstance(llm.engine.mtp.logits, LinearHead) and llm.engine.mtp.graphs is not None
    counts = count_proposals(llm.engine.mtp)
    assert tokens(llm, PROMPTS) == [w[:n] for w, n in zip(want, LENGTHS)]
    assert counts["graph"] > 0
    spec = dict(MTP_FP8, forced_acceptance=0.5)
    graphs = tokens(engine(path, spec), PROMPTS, seed=0)
    eager = engine(path, spec)
    eager.engine.mtp.graphs = None
    assert tokens(eager, PROMPTS, seed=0) == graphs


def test_mtp_fp8_in_bf16_matches_plain_bf16(target):
    path, _ = target
    assert tokens(engine(path, MTP_FP8, "bfloat16"), PROMPTS) == tokens(engine(path, None, "bfloat16"), PROMPTS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_draft_model_in_fp8_keeps_greedy_tokens_through_the_graphs(tiny_dir, perturbed_dir, dtype):  # noqa: F811
    spec = {"method": "draft_model", "model": str(perturbed_dir), "num_speculative_tokens": 4, "quantization": "fp8"}
    prompts = [[5, 17, 42, 99, 5, 17, 42, 99], [11, 200, 14], [7, 7, 1, 2, 3, 7, 7, 1, 2]]
    want = tokens(engine(tiny_dir, None, dtype), prompts)
    llm = engine(tiny_dir, spec, dtype)
    assert isinstance(llm.engine.draft.runner.model.lm_head, LinearHead) and llm.engine.draft.graphs is not None
    counts = count_proposals(llm.engine.draft)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in LENGTHS])
    assert [o.token_ids for o in outs] == want
    assert counts["graph"] > 0 and sum(o.metrics.num_accepted_tokens for o in outs) > 0
