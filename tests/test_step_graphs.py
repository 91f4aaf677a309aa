"""The host side of the mixed-step graphs: their token buckets and the flat batch they are fed (the replay itself is
checked on the GPU in test_gpu_engine.py), and the capture rule every graph follows (engine/graph_capture.py)."""

from __future__ import annotations

import contextlib
import gc

import pytest

from orinfer.engine import graph_capture
from orinfer.engine.scheduler import StepPlan
from orinfer.engine.sequence import Sequence
from orinfer.engine.step_graphs import graph_token_limit, token_buckets
from orinfer.engine.step_inputs import step_inputs
from orinfer.sampling_params import SamplingParams


def test_token_buckets_cover_every_count_with_little_padding():
    buckets = token_buckets(1024)
    assert buckets[:5] == [8, 16, 32, 64, 128] and buckets[-1] == 1024 and buckets == sorted(set(buckets))
    for tokens in range(1, 1025):
        bucket = next(b for b in buckets if b >= tokens)
        assert (bucket - tokens) * 3 < bucket or tokens <= 128
    assert token_buckets(100) == [8, 16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(2048)[-9:] == list(range(1024, 2049, 128))


def test_moe_models_replay_larger_steps_from_graphs():
    """Dense models' graphs stop at 1024 tokens, mixture-of-experts models' (hybrid ones too) at 4096 (their eager
    steps are host-bound well past 1024); none beyond the engine's token budget."""
    assert graph_token_limit(0, 2048) == 1024 and graph_token_limit(0, 512) == 512
    assert graph_token_limit(128, 2048) == 2048 and graph_token_limit(256, 8192) == 4096
    assert graph_token_limit(128, 300) == 300


def test_step_inputs_lay_out_decode_rows_then_chunks():
    decoding = Sequence("a", [1, 2, 3, 4], SamplingParams(max_tokens=4))
    decoding.append_token(5)
    decoding.block_table = [7, 2]
    decoding.num_computed_tokens = 4  # its newest token (5, at position 4) runs now
    chunked = Sequence("b", list(range(10, 20)), SamplingParams(max_tokens=4))
    chunked.block_table = [3, 9, 5]
    chunked.num_computed_tokens = 4  # the chunk of tokens 4..6 runs now, the prompt does not end: no sample
    plan = StepPlan()
    plan.add(decoding, 1)
    plan.add(chunked, 3)
    inputs = step_inputs(plan, block_size=4)
    assert inputs.ids == [5, 14, 15, 16]
    assert inputs.positions == [4, 4, 5, 6]
    assert inputs.slots == [2 * 4 + 0, 9 * 4 + 0, 9 * 4 + 1, 9 * 4 + 2]
    assert inputs.starts == [0, 1, 4] and inputs.context_lens == [5, 7] and inputs.max_query_len == 3
    assert inputs.block_tables == [[7, 2], [3, 9, 5]] and not inputs.from_start
    assert inputs.sample_rows == [0]


def test_capture_graph_pauses_garbage_collection_for_the_capture(monkeypatch):
    """No collection may free an old graph mid-capture (orinfer/engine/graph_capture.py): the collector is off inside
    the capture and back on afterwards, also when the capture raises; a collector the caller had off stays off."""
    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None):  # torch.cuda.graph needs a GPU
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(graph_capture.torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with graph_capture.capture_graph(None):
        seen.append(gc.isenabled())
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(RuntimeError), graph_capture.capture_graph(None):
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with graph_capture.capture_graph(None):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
