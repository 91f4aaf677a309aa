"""Speculative decoding of hybrid Qwen3.5 targets under tensor parallelism on 2 GPUs (NCCL, the triton backend, CUDA
graphs): the state rollback inside the mixed-step graphs' replays (each rank keeps its heads' verify rows and
advances its shard of the state, in rank 0's order), the MTP head split over the GPUs beside decode graphs that hand
it their hidden states, a draft model whole on rank 0 with graphs of its own. Greedy tokens must be the one-GPU
engine's, with and without speculation."""

from __future__ import annotations

import pytest
import torch

from hf_models import build_hf_model, build_hf_qwen3_5, build_hf_qwen3_5_moe, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.spec_decode.config import SpeculativeConfig
from test_qwen3_5 import _with_mtp
from test_spec_decode_hybrid import NGRAM, PROMPTS, OracleProposer
from test_tensor_parallel_spec import _recording

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                  reason="tensor parallelism over 2 GPUs needs 2 CUDA devices")]

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
MODELS = {"dense": lambda: build_hf_qwen3_5("qwen3.5-interval4-untied"),
          "moe": lambda: build_hf_qwen3_5_moe("qwen3.5moe-e6-top2")}


def engine(path, world: int, spec: dict | None = None, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cuda", backend="triton", progress=False, kv_cache_bytes=64 << 20,
               max_num_seqs=8, max_num_batched_tokens=12, block_size=4, num_state_snapshots=8,
               tensor_parallel_size=world, speculative_config=spec, **settings)


@pytest.fixture(scope="module", params=sorted(MODELS))
def target(request, tmp_path_factory):
    """(checkpoint with a random MTP head, the one-GPU engine's greedy tokens without speculation)."""
    plain = save_hf_model(MODELS[request.param](), tmp_path_factory.mktemp(request.param))
    path = _with_mtp(plain, tmp_path_factory.mktemp(request.param + "_mtp"))
    with engine(path, 1) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return path, want


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def test_every_acceptance_length_prefix_hits_and_ngram(target):
    """The spoiling oracle (every acceptance length, prompt chunks of 12 beside verify rows), the same prompts again
    (prefix-cache hits resuming state snapshots), then n-gram drafts: on 2 GPUs and on 1."""
    path, want = target
    results = {}
    for world in (2, 1):
        with engine(path, world, NGRAM) as llm:
            assert llm.engine.runner.step_graphs is not None and llm.engine.runner.graphs is not None
            outs = []
            for _ in range(2):
                llm.engine.proposer = OracleProposer(PROMPTS, want)
                outs.append(llm.generate(PROMPTS, GREEDY))
            llm.engine.set_speculation(SpeculativeConfig.parse(NGRAM))
            outs.append(llm.generate(PROMPTS, GREEDY))
        results[world] = outs
    for outs in (*results[2], *results[1]):
        assert _tokens(outs) == want
    oracle, again, _ = results[2]
    drafted = sum(o.metrics.num_draft_tokens for o in oracle)
    accepted = sum(o.metrics.num_accepted_tokens for o in oracle)
    assert 0 < accepted < drafted
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_mtp_and_draft_model_on_two_gpus(target, method, tmp_path):
    """MTP (the head split over both GPUs) and a draft model (whole on GPU 0): the one-GPU engine's tokens and drafts."""
    path, want = target
    if method == "mtp":
        spec = {"method": "mtp", "num_speculative_tokens": 3}
    else:
        draft = save_hf_model(build_hf_model("qwen3-mha-tied", vocab_size=211), tmp_path / "draft")
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    drafts = {}
    for world in (2, 1):
        with engine(path, world, spec) as llm:
            made = _recording(llm)
            assert _tokens(llm.generate(PROMPTS, GREEDY)) == want
        drafts[world] = made
    assert drafts[2] == drafts[1] and any(any(d) for d in drafts[2])
