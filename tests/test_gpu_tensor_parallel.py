"""Tensor parallelism on GPUs (NCCL, one process per GPU): CUDA-graph replays with their all-reduces, mirrored from
rank 0, must give the one-GPU engine's greedy tokens; a dead worker must fail the engine, not hang it."""

from __future__ import annotations

import time

import pytest
import torch

from orinfer import LLM, SamplingParams
from orinfer.distributed.executor import WorkerDiedError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

PROMPTS = ["Alice was beginning to get very tired of sitting by her sister on the bank", "Down, down, down.",
           "The rabbit-hole went straight on like a tunnel", "Curiouser and curiouser!", "Off with her head!"]


def engine(tiny_dir, world: int, **settings) -> LLM:
    return LLM(tiny_dir, dtype="float32", device="cuda", backend="triton", progress=False, kv_cache_bytes=64 << 20,
               max_num_seqs=8, max_num_batched_tokens=64, tensor_parallel_size=world, **settings)


def outputs(llm: LLM, params: SamplingParams) -> list:
    # One prompt alone (batch bucket 1), then all of them (mixed steps: prompts beside decode rows, then bucket 8).
    return llm.generate(PROMPTS[:1], params) + llm.generate(PROMPTS, params)


@pytest.mark.parametrize("settings", [{}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
                                      {"cuda_graph": False}])
def test_two_gpus_match_one_with_graphs(tiny_dir, settings):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    with engine(tiny_dir, 2, **settings) as two:
        if settings.get("cuda_graph", True):
            assert two.engine.runner.graphs is not None and two.engine.runner.step_graphs is not None
        got = outputs(two, params)
    with engine(tiny_dir, 1, **settings) as one:
        want = outputs(one, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)


def test_dead_worker_fails_the_engine(tiny_dir):
    llm = engine(tiny_dir, 2)
    executor = llm.engine.parts.executor
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(PROMPTS[:1], params)
    executor._procs[0].kill()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError):
        for _ in range(100):
            llm.generate(PROMPTS[:1], params)
    assert time.monotonic() - start < 60
    llm.close()
    assert all(proc.poll() is not None for proc in executor._procs)
