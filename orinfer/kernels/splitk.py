"""Serial split-K for tensor-core kernels with few output tiles: the last program of a tile sums the others' partials.

A decode-sized GEMM has only N / BLOCK_N output tiles (Qwen3-8B's o projection: 32 at 128 rows a tile), far too few
programs to keep enough bytes in flight on 132 SMs, so K is split over SPLIT programs per tile. Each stores its fp32
partial sums [BLOCK_M, BLOCK_N] in a workspace [SPLIT, PARTS, M, N] (PARTS = 2 for gate and up), then increments the
tile's counter; the program that finds SPLIT - 1 there (the last to finish) adds the SPLIT partials in split order
(deterministic: no float atomics), finishes the tile and sets the counter back to 0 (`splitk_store`, which a kernel
calls with its tile's fp32 sums; it stores them directly when SPLIT == 1). One launch (a separate reduce
kernel would cost a launch per projection, ~4 per layer at batch 1), CUDA-graph safe: the counters live in one
persistent zeroed buffer per device (`counters`) and every launch leaves them at 0.

Memory ordering: all threads store their partials, a CTA barrier, then one thread's acq_rel atomic at GPU scope (Triton
issues a scalar atomic from one thread and broadcasts its result through shared memory, behind another barrier): the
release publishes the whole CTA's stores, the acquire of the last program sees every other program's. The partials are
read with `.cg` (L2, not a possibly stale L1 line from an earlier launch).
Launches sharing the buffer must be ordered (one stream, as the engine runs): two grids in flight on different streams
could use the same tile's counter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.tiles import store_tile

MAX_TILES = 1 << 16   # counters per device: more tiles than any split launch has (lm_head at 128 rows: 1187)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The device's persistent int32 [MAX_TILES] tile counters (zero between launches)."""
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return buf


def plan(tiles: int, steps: int, split_k: int, sms: int, min_steps: int = 4) -> tuple[int, int]:
    """(splits, K steps per split) for `tiles` output tiles of `steps` K steps: `split_k` splits at most (0: a power of
    two giving at least ~2 programs per SM, each with at least `min_steps` steps), no empty split, and none when
    there are more tiles than counters."""
    if split_k == 0:
        split_k = 1
        while tiles * split_k < 2 * sms and steps // (split_k * 2) >= min_steps:
            split_k *= 2
    if tiles > MAX_TILES:
        split_k = 1
    per_split = triton.cdiv(steps, max(1, min(split_k, steps)))
    return triton.cdiv(steps, per_split), per_split


@triton.jit
def _plane_offsets(plane, offs_m, offs_n, M, N):
    """int64 offsets of the tile's elements in workspace plane `plane` ([M, N] each, SPLIT * PARTS of them). The
    launcher turns an int argument equal to 1 (M = 1) into a constexpr: `plane * M` may be a plain int, so the row
    index becomes a tensor (+ offs_m) before the widening."""
    return (plane * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]


@triton.jit
def splitk_publish(g, u, ws_ptr, cnt_ptr, tile, offs_m, offs_n, mask, M, N, SPLIT: tl.constexpr,
                   PARTS: tl.constexpr):
    """Stores this program's partial sums [BLOCK_M, BLOCK_N] (`g`, and `u` when PARTS == 2) as its split's parts
    (program_id(1)), counts the program in, and returns whether it is the tile's last (an i1 scalar, the same type on
    every path): then it must call `splitk_total` and `splitk_release`."""
    split = tl.program_id(1)
    tl.store(ws_ptr + _plane_offsets(split * PARTS, offs_m, offs_n, M, N), g, mask=mask)
    if PARTS == 2:
        tl.store(ws_ptr + _plane_offsets(split * PARTS + 1, offs_m, offs_n, M, N), u, mask=mask)
    tl.debug_barrier()                      # every thread's partials are issued before the release below
    return tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1


@triton.jit
def splitk_total(ws_ptr, part: tl.constexpr, offs_m, offs_n, mask, M, N, SPLIT: tl.constexpr, PARTS: tl.constexpr):
    """Sum over the splits, in split order, of part `part` of the tile's partials [BLOCK_M, BLOCK_N] fp32. A loop, not
    unrolled: unrolled, the compiler issued all SPLIT loads at once (the W8A8 GEMM's 64 x 128 tile at 8 splits: 255
    registers and spills; looped: 196, none)."""
    total = tl.load(ws_ptr + _plane_offsets(part, offs_m, offs_n, M, N), mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, SPLIT):
        total += tl.load(ws_ptr + _plane_offsets(s * PARTS + part, offs_m, offs_n, M, N), mask=mask, other=0.0,
                         cache_modifier=".cg")
    return total


@triton.jit
def splitk_release(cnt_ptr, tile):
    """Sets the tile's counter back to 0 for the next launch (called once, by the tile's last program)."""
    tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def splitk_store(g, u, ws_ptr, cnt_ptr, tile, out_ptr, b_ptr, rn, offs_m, offs_n, mask, M, N, stride_om,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, CLAMP16: tl.constexpr):
    """Stores a tile's result (`tiles.store_tile` of the fp32 sums g, u [BLOCK_M, BLOCK_N]): directly when SPLIT == 1,
    else through the workspace by the tile's last program (`tile`: its counter). The runtime branch on "last" assigns
    only names of its own, so no value changes type across it (what the GPU compiler requires of a runtime `if`,
    and the interpreter does not check)."""
    if SPLIT == 1:
        store_tile(out_ptr, g, u, b_ptr, rn, offs_m, offs_n, mask, stride_om, HAS_BIAS, GATED, CLAMP16)
    else:
        PARTS: tl.constexpr = 2 if GATED else 1
        if splitk_publish(g, u, ws_ptr, cnt_ptr, tile, offs_m, offs_n, mask, M, N, SPLIT, PARTS):
            total_g = splitk_total(ws_ptr, 0, offs_m, offs_n, mask, M, N, SPLIT, PARTS)
            total_u = total_g
            if GATED:
                total_u = splitk_total(ws_ptr, 1, offs_m, offs_n, mask, M, N, SPLIT, PARTS)
            store_tile(out_ptr, total_g, total_u, b_ptr, rn, offs_m, offs_n, mask, stride_om, HAS_BIAS, GATED,
                       CLAMP16)
            splitk_release(cnt_ptr, tile)
