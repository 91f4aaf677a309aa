"""Weights brought into L2 ahead of their GEMV, from a side stream of the decode graphs (Hopper's
`cp.async.bulk.prefetch.L2`).

Why: a batch-1 decode layer has a phase in which HBM is nearly idle. QK-norm + RoPE, attention and its split combine
move a few MB over ~6 us, and then the o projection reads 8.7 MB of AWQ weights (Qwen3-8B). Forking a prefetch of o's
weights onto a side stream as that phase starts lets o read them from L2: the batch-1 AWQ step replays in 1.740 ms
instead of 1.750 on the H200 (docs/performance.md). The first 40% of the next layer's qkv rows, prefetched in the same
phase, take off 13 us more. Only sets of up to MAX_PREFETCH_BYTES are prefetched: bf16's o projection is four times
larger, and prefetching it slowed the bf16 step.

Where it was tried and lost (same measurements): issuing the requests from a kernel of the step's own chain. That was
either a PDL kernel between qkv and RoPE, or decode attention's programs after their wait, and it cost 50-90 us per
step: a program holding bulk prefetches does not retire until they land, so the chain waits for them. Prefetching
gate_up's first rows as well made the step slower, and the next layer's qkv during the MLP's tail gained 3 us at most.

Kernel: request r of a plan (a row of its table: address, bytes) is issued by program r mod P, lane r div P. So a
plan spreads over all its programs: each SM's TMA unit works through its own requests one after another, and 256 KB
requests on 2 SMs took 25 us for o. Bytes moved from HBM into L2: the plan's total. Nothing is read into registers.

Use: layers call `prefetch_weights(linear, fraction)` where the prefetch should start. It does nothing except inside
`prefetch_scope`, which the decode graphs open around their warm-up (plans are built: their tables are uploaded,
which capture forbids) and around their capture (each call forks a side stream off the capturing one and launches
the plan there; the scope joins the side stream back before the capture ends).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
import triton
import triton.language as tl

# Larger sets are not prefetched: bf16 Qwen3-8B's o projection (33.5 MB) made the step 4.097 ms instead of 3.964:
# more than the idle phase can fetch, it evicts and competes with what the chain reads itself.
MAX_PREFETCH_BYTES = 16 << 20
REQUEST_BYTES = 16 << 10  # per bulk request: 4 and 16 KB measured alike, 64 KB slower
_LANES = 32  # one warp per program


@triton.jit
def _l2_prefetch_kernel(table_ptr, n_requests, LANES: tl.constexpr):
    program, n_programs = tl.program_id(0), tl.num_programs(0)
    r = tl.arange(0, LANES) * n_programs + program
    valid = r < n_requests
    r = tl.where(valid, r, 0)
    addr = tl.load(table_ptr + 2 * r).to(tl.pointer_type(tl.int8))
    size = tl.load(table_ptr + 2 * r + 1).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, valid.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def request_rows(spans: Sequence[tuple[int, int]], request_bytes: int = REQUEST_BYTES) -> list[tuple[int, int]]:
    """(address, bytes) spans -> bulk requests (address, bytes) of at most `request_bytes` each, in order; each span's
    tail of under 16 bytes is left out (a request's size is a multiple of 16, its address 16-byte aligned)."""
    if request_bytes <= 0 or request_bytes % 16:
        raise ValueError(f"request_bytes must be a positive multiple of 16, got {request_bytes}")
    rows = []
    for addr, nbytes in spans:
        if addr % 16:
            raise ValueError(f"a bulk prefetch needs a 16-byte-aligned address, got {addr:#x}")
        total = nbytes // 16 * 16
        rows += [(addr + start, min(request_bytes, total - start)) for start in range(0, total, request_bytes)]
    return rows


class PrefetchPlan:
    """The bulk requests that bring `tensors` into L2 (`request_rows` of their bytes). Tensors must be contiguous,
    16-byte aligned and on one CUDA device. The request table lives on the device as long as the plan does: a
    captured graph reads it on every replay."""

    def __init__(self, tensors: Sequence[torch.Tensor], request_bytes: int = REQUEST_BYTES) -> None:
        for t in tensors:
            if not (t.is_cuda and t.is_contiguous() and t.device == tensors[0].device):
                raise ValueError("PrefetchPlan needs contiguous tensors on one CUDA device")
        rows = request_rows([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors], request_bytes)
        self.n_requests = len(rows)
        self.bytes = sum(size for _, size in rows)
        self.table = torch.tensor(rows, dtype=torch.int64, device=tensors[0].device) if rows else None

    def launch(self) -> None:
        """Issues every request on the current stream. Nothing waits for the data; the kernel's programs retire once
        their requests have landed."""
        if self.table is not None:
            grid = (triton.cdiv(self.n_requests, _LANES),)
            _l2_prefetch_kernel[grid](self.table, self.n_requests, LANES=_LANES, num_warps=1)


class _Scope:
    def __init__(self, device: torch.device, launch: bool) -> None:
        self.launch = launch
        self.side = torch.cuda.Stream(device) if launch else None
        self.forked = False


_plans: dict[tuple[int, ...], PrefetchPlan] = {}
_scope: _Scope | None = None


@contextlib.contextmanager
def prefetch_scope(device: torch.device, launch: bool) -> Iterator[None]:
    """Inside, `prefetch_weights` builds its plans (launch=False: a warm-up run) or forks them onto a side stream
    (launch=True: a CUDA-graph capture, whose capturing stream waits for the side stream at the scope's end)."""
    global _scope
    if _scope is not None:
        raise RuntimeError("prefetch scopes do not nest")
    _scope = _Scope(device, launch)
    try:
        yield
        if _scope.forked:
            torch.cuda.current_stream(device).wait_stream(_scope.side)
    finally:
        _scope = None


def prefetch_weights(linear: torch.nn.Module, fraction: float = 1.0) -> None:
    """Asks L2 for the weights `linear` streams in decode (its `decode_weights()`, each [output rows, ...]) from
    here on, in the background (see the module docstring): the first `fraction` of each tensor's rows, which the
    GEMV's first programs read. A no-op outside `prefetch_scope`, and for sets of over MAX_PREFETCH_BYTES. Plans
    are cached per set of tensor addresses and sizes: weights do not move once loaded."""
    scope = _scope
    if scope is None:
        return
    tensors = linear.decode_weights()
    if fraction < 1.0:
        tensors = tuple(t[:math.ceil(t.shape[0] * fraction)] for t in tensors)
    if not tensors or sum(t.numel() * t.element_size() for t in tensors) > MAX_PREFETCH_BYTES:
        return
    key = tuple((t.data_ptr(), t.numel() * t.element_size()) for t in tensors)
    plan = _plans.get(key)
    if not scope.launch:
        if plan is None:
            _plans[key] = plan = PrefetchPlan(tensors)
            plan.launch()  # compiles the kernel before any capture
        return
    if plan is None:
        raise RuntimeError("prefetch_weights: no plan for these tensors; run the step once in a launch=False "
                           "scope before capturing it")
    main = torch.cuda.current_stream()
    scope.side.wait_stream(main)
    with torch.cuda.stream(scope.side):
        plan.launch()
    scope.forked = True
