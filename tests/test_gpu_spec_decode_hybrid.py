"""Speculative decoding of hybrid targets on the GPU's triton backend with CUDA graphs (tiny Qwen3.5 dense and MoE with
an MTP head, fp32): verify steps replay mixed-step graphs that keep the linear-attention inputs, the state rollback
runs the Triton conv and recurrent kernels, the MTP head drafts; greedy tokens must be HF's."""

from __future__ import annotations

import pytest
import torch

from hf_models import build_hf_qwen3_5, build_hf_qwen3_5_moe, hf_greedy, save_hf_model
from orinfer import LLM, SamplingParams
from test_qwen3_5 import _with_mtp
from test_spec_decode_hybrid import NGRAM, PROMPTS, OracleProposer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 40
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
MODELS = {"dense": lambda: build_hf_qwen3_5("qwen3.5-interval4-untied"),
          "moe": lambda: build_hf_qwen3_5_moe("qwen3.5moe-e6-top2")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def target(request, tmp_path_factory):
    hf = MODELS[request.param]()
    path = _with_mtp(save_hf_model(hf, tmp_path_factory.mktemp(request.param)),
                     tmp_path_factory.mktemp(request.param + "_mtp"))
    return path, [hf_greedy(hf, prompt, STEPS) for prompt in PROMPTS]


def engine(path, spec: dict | None, dtype: str = "float32", **settings) -> LLM:
    return LLM(path, dtype=dtype, device="cuda", backend="triton", block_size=16, kv_cache_bytes=64 << 20,
               max_num_seqs=8, max_num_batched_tokens=32, progress=False, speculative_config=spec, **settings)


def _counts(outs) -> tuple[int, int]:
    return sum(o.metrics.num_draft_tokens for o in outs), sum(o.metrics.num_accepted_tokens for o in outs)


def test_every_acceptance_length_with_graphs(target):
    path, want = target
    llm = engine(path, NGRAM)
    assert llm.engine.runner.step_graphs is not None and llm.engine.runner.rollback is not None
    llm.engine.proposer = OracleProposer(PROMPTS, want)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    drafted, accepted = _counts(outs)
    assert 0 < accepted < drafted
    assert [o.token_ids for o in engine(path, None).generate(PROMPTS, GREEDY)] == want
    no_graphs = engine(path, NGRAM, cuda_graph=False)
    no_graphs.engine.proposer = OracleProposer(PROMPTS, want)
    assert [o.token_ids for o in no_graphs.generate(PROMPTS, GREEDY)] == want


def test_ngram_and_mtp_with_graphs(target):
    path, want = target
    for spec in (NGRAM, {"method": "mtp", "num_speculative_tokens": 3}):
        outs = engine(path, spec).generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == want, spec["method"]
        assert _counts(outs)[0] > 0


def test_bf16_mtp_forced_acceptance_runs_whole_verify_steps(target):
    path, _ = target
    llm = engine(path, {"method": "mtp", "num_speculative_tokens": 3, "forced_acceptance": 1.0}, dtype="bfloat16")
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 17
    assert (out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens) == (12, 12)


def test_mtp_drafts_again_after_plain_decode_graph_steps(target):
    """Drafts that never pay pause speculation (plain steps replayed from the decode graphs, which hand their hidden
    states to the MTP head too); each later try finds the newest hidden state and verifies again."""
    path, _ = target
    llm = engine(path, {"method": "mtp", "num_speculative_tokens": 3, "forced_acceptance": 0.0})
    out = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert llm.engine.num_lookahead_steps > 0  # plain steps ran between the tries
    assert out.metrics.num_verify_steps >= 4
