"""Speculative decoding on the GPU's triton backend: verify steps replay mixed-step CUDA graphs beside plain decode
graphs and lookahead steps; greedy output must equal plain decoding's (fp32, the trained tiny Qwen3)."""

from __future__ import annotations

import pytest
import torch

from orinfer import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["Alice was beginning to get very tired of sitting by her sister on the bank", "Down, down, down.",
           "The rabbit-hole went straight on like a tunnel"]


def engine(tiny_dir, spec: dict | None) -> LLM:
    return LLM(tiny_dir, dtype="float32", device="cuda", backend="triton", progress=False, kv_cache_bytes=64 << 20,
               max_num_seqs=8, max_num_batched_tokens=64, speculative_config=spec)


def test_ngram_greedy_matches_plain_with_graphs(tiny_dir):
    plain, spec = engine(tiny_dir, None), engine(tiny_dir, {"method": "ngram", "num_speculative_tokens": 4})
    assert spec.engine.runner.step_graphs is not None
    # 160 tokens as in the CPU twin: the trained tiny model's first 96 greedy tokens draft 20 n-gram tokens and accept
    # none of them (run 407, the same counts on the CPU), 160 accept some.
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True, logprobs=2)
    want, got = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert 0 < accepted < drafted
    blocks = spec.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    seeded = SamplingParams(temperature=0.8, max_tokens=64, seed=5, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(PROMPTS, seeded)] == [o.token_ids for o in spec.generate(PROMPTS, seeded)]


def test_draft_model_proposes_through_decode_graph_replays(tiny_dir):
    """The tiny model drafting for itself: its graphs replay k steps per proposal; every draft is accepted."""
    plain = engine(tiny_dir, None)
    spec = engine(tiny_dir, {"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 3})
    assert spec.engine.draft.runner.graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True)
    want, got = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in got] == [(30, 30)] * 3
