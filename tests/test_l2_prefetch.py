"""L2 prefetch of decode weights (kernels/l2_prefetch.py): the request table on the CPU; on CUDA, the plan, the
scope's build-then-launch rule, and a captured graph with a prefetch forked onto its side stream."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orinfer.kernels import l2_prefetch
from orinfer.kernels.l2_prefetch import PrefetchPlan, prefetch_scope, prefetch_weights, request_rows


def test_request_rows_cover_each_span_in_aligned_pieces():
    rows = request_rows([(0x1000, 96), (0x20000, 64)], request_bytes=32)
    assert rows == [(0x1000, 32), (0x1020, 32), (0x1040, 32), (0x20000, 32), (0x20020, 32)]


def test_request_rows_keep_a_last_partial_multiple_of_16_and_drop_the_rest():
    # 60 bytes: one full request, then 16 of the remaining 28 (the 12 past them are under 16 bytes).
    assert request_rows([(0x1000, 60)], request_bytes=32) == [(0x1000, 32), (0x1020, 16)]
    assert request_rows([(0x1000, 15)], request_bytes=32) == []


@pytest.mark.parametrize("bad", [0, -16, 24])
def test_request_rows_reject_a_request_size_that_is_no_multiple_of_16(bad):
    with pytest.raises(ValueError, match="multiple of 16"):
        request_rows([(0x1000, 64)], request_bytes=bad)


def test_request_rows_reject_an_unaligned_address():
    with pytest.raises(ValueError, match="16-byte-aligned"):
        request_rows([(0x1008, 64)])


def test_prefetch_weights_does_nothing_outside_a_scope():
    class Exploding(nn.Module):
        def decode_weights(self):
            raise AssertionError("asked for its weights outside a prefetch scope")

    prefetch_weights(Exploding())


class _Linear(nn.Module):
    """Stands in for a model linear: a weight, `decode_weights`, and a forward that reads it."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, cols, device="cuda"), requires_grad=False)

    def decode_weights(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows,cols", [(1000, 1000), (3, 5)])
def test_plan_requests_cover_the_tensor_and_leave_it_as_it_was(rows, cols):
    w = torch.randn(rows, cols, device="cuda")
    before = w.clone()
    plan = PrefetchPlan([w], request_bytes=1024)
    table = plan.table.cpu().tolist()
    assert table[0][0] == w.data_ptr() and plan.bytes == rows * cols * 4 // 16 * 16
    assert all(a + n == b for (a, n), (b, _) in zip(table, table[1:]))  # contiguous, in order
    plan.launch()
    torch.cuda.synchronize()
    assert torch.equal(w, before)


@pytest.mark.gpu
@needs_cuda
def test_scope_builds_plans_in_warm_up_and_launches_them_in_a_captured_graph(monkeypatch):
    """A warm-up scope builds the plan; a launch scope inside a CUDA-graph capture forks it onto a side stream and
    joins it back, so the capture ends cleanly and the replayed graph computes what the eager run did."""
    monkeypatch.setattr(l2_prefetch, "_plans", {})
    linear = _Linear(256, 512)
    x = torch.randn(4, 512, device="cuda")

    def step() -> torch.Tensor:
        prefetch_weights(linear)
        return linear(x * 2)

    with prefetch_scope(x.device, launch=False):
        expected = step()
        prefetch_weights(linear, 0.25)   # the first quarter of the rows: a plan of its own
    plans = sorted(l2_prefetch._plans.values(), key=lambda p: p.bytes)
    assert [p.bytes for p in plans] == [64 * 512 * 4, 256 * 512 * 4]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), prefetch_scope(x.device, launch=True):
        out = step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, linear(x * 2))
    assert not torch.equal(out, expected)


@pytest.mark.gpu
@needs_cuda
def test_a_launch_scope_without_a_built_plan_says_so(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "_plans", {})
    linear = _Linear(64, 64)
    with pytest.raises(RuntimeError, match="no plan"), prefetch_scope(linear.weight.device, launch=True):
        prefetch_weights(linear)
    with pytest.raises(RuntimeError, match="do not nest"), prefetch_scope(linear.weight.device, launch=False):
        with prefetch_scope(linear.weight.device, launch=False):
            pass



class _Recorder:
    """Stands in for an Ops table: records each `prefetch_weights(linear, fraction)` call."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module, float]] = []

    def prefetch_weights(self, linear: nn.Module, fraction: float = 1.0) -> None:
        self.calls.append((linear, fraction))


class _CpuLinear(nn.Module):
    def __init__(self, ops: _Recorder, rows: int) -> None:
        super().__init__()
        self.ops, self.rows = ops, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], self.rows)


class _Layer(nn.Module):
    """A decoder layer as decode_hooks reads one: an attention section from qkv to o."""
    attention_section = ("qkv_proj", "o_proj")

    def __init__(self, ops: _Recorder) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = _CpuLinear(ops, 3072), _CpuLinear(ops, 4096)


def test_the_attention_section_prefetches_only_for_small_batches():
    from orinfer.layers import decode_hooks

    ops = _Recorder()
    model = nn.Sequential(_Layer(ops), _Layer(ops))
    decode_hooks.install_decode_hooks(model)
    model[0].qkv_proj(torch.zeros(decode_hooks.PREFETCH_MAX_ROWS, 4096))
    assert ops.calls == [(model[0].o_proj, 1.0), (model[1].qkv_proj, decode_hooks.NEXT_SECTION_PREFETCH)]
    ops.calls.clear()
    model[0].qkv_proj(torch.zeros(decode_hooks.PREFETCH_MAX_ROWS + 1, 4096))
    assert ops.calls == []  # a large batch's attention streams its KV: nothing competes with it
