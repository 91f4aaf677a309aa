"""Token-to-expert sorting with block alignment on the device (`moe_align_ref`'s contract), for the grouped GEMMs.

From topk_ids [T, k] (N = T*k pairs, pair p = t*k + j chose expert ids.flat[p]) it makes

    sorted_pairs [P] int32   the pairs by expert (stable: ascending p within an expert); each expert's segment starts
                             at a multiple of BLOCK_M and is padded up to one with N (no pair); the tail holds N too
    block_expert [P/BLOCK_M] the expert of each BLOCK_M block of sorted_pairs, -1 past the last segment

P = `moe_align_size(N, E, BLOCK_M)` = N + min(N, E) * (BLOCK_M - 1) rounded up to whole blocks: fixed by the shapes,
so the buffers and the grids of the GEMMs that read them are known on the host (no sync; CUDA-graph safe); a GEMM
program whose block maps to -1 returns at once.

Three launches, deterministic (no atomics), for N pairs cut into chunks of CHUNK:
  1. `_count_kernel`, grid (chunks,): counts[c, e] = pairs of chunk c that chose e (one-hot sums over E tiles of 64),
     and fills its share of sorted_pairs with N (the padding value).
  2. `_offsets_kernel`, one program: counts[c, e] becomes the exclusive prefix over chunks (pairs of e in chunks before
     c), start[e] = the exclusive prefix over experts of the padded totals (start[E]: all of them).
  3. `_scatter_kernel`, grid (chunks,): pair p of chunk c goes to start[e] + counts[c, e] + (pairs of e before p in
     the chunk: a [CHUNK, CHUNK] comparison), and program c finds the expert of its share of the blocks from the
     segment ends start[1..E]. (In the one-program offsets kernel, that loop over every block took ~23 us a call at
     2048 tokens of Qwen3.5-35B-A3B, 541 blocks against 257 ends, NOTES run 464.)
Traffic: N ids read twice, P + N + P/BLOCK_M int32 written, chunks*E*4*3 of counts: microseconds next to the GEMMs.

Every size, grid and loop bound above comes from N, E and BLOCK_M alone, never from the ids, so a CUDA graph captured
on one routing replays correctly on any other of the same N: P covers the worst case and the GEMMs skip the -1 blocks
on the device. An id outside 0..E-1 (the contract excludes them) is counted nowhere and placed nowhere, rather than
read as an offset out of bounds: memory stays safe whatever the ids hold, and the pair gets no expert.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device
from orinfer.kernels.moe import moe_align_size

CHUNK = 128          # pairs per program of the count and scatter kernels
E_TILE = 64          # experts per one-hot tile in the count kernel


class MoeAlignment(NamedTuple):
    sorted_pairs: torch.Tensor   # [P] int32
    block_expert: torch.Tensor   # [P / block_m] int32
    block_m: int


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, sorted_ptr, N, E, P, FILL, CHUNK: tl.constexpr, E_TILE: tl.constexpr):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1).to(tl.int32)
    for e0 in range(0, E, E_TILE):
        offs_e = e0 + tl.arange(0, E_TILE)
        n = tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + c * E + offs_e, n, mask=offs_e < E)
    # This program's share of the padding value: FILL entries (a multiple of CHUNK) of sorted_pairs.
    end = tl.minimum(c * FILL + FILL, P)
    for f0 in range(c * FILL, end, CHUNK):
        offs_f = f0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs_f, tl.zeros([CHUNK], dtype=tl.int32) + N, mask=offs_f < end)


@triton.jit
def _offsets_kernel(counts_ptr, start_ptr, chunks, E, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                    BLOCK_E: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, chunks, BLOCK_C):                        # exclusive prefix over chunks, in place
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ptrs = counts_ptr + offs_c[:, None] * E + offs_e[None, :]
        mask = (offs_c[:, None] < chunks) & e_mask[None, :]
        n = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(n, axis=0) - n + total[None, :], mask=mask)
        total += tl.sum(n, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    tl.store(start_ptr + offs_e, end - padded, mask=e_mask)
    tl.store(start_ptr + E, tl.sum(padded, axis=0))


@triton.jit
def _scatter_kernel(ids_ptr, counts_ptr, start_ptr, sorted_ptr, block_ptr, N, E, chunks, num_blocks,
                    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    c = tl.program_id(0)
    # This program's share of block_expert: a block's expert is the number of segments that end at or before its
    # first row (empty segments included); past the last segment, -1.
    offs_e = tl.arange(0, BLOCK_E)
    end = tl.load(start_ptr + 1 + offs_e, mask=offs_e < E, other=2147483647)   # padding experts never end first
    used = tl.load(start_ptr + E)
    share = tl.cdiv(num_blocks, chunks)
    for b0 in range(c * share, tl.minimum(c * share + share, num_blocks), BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        pos = offs_b * BLOCK_M
        expert = tl.sum((end[None, :] <= pos[:, None]).to(tl.int32), axis=1)
        tl.store(block_ptr + offs_b, tl.where(pos < used, expert, -1),
                 mask=(offs_b < c * share + share) & (offs_b < num_blocks))
    offs_j = tl.arange(0, CHUNK)
    offs = c * CHUNK + offs_j
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1).to(tl.int32)
    valid = (offs < N) & (ids >= 0) & (ids < E)                 # an id out of range was not counted: not placed
    before = (ids[:, None] == ids[None, :]) & (offs_j[None, :] < offs_j[:, None])
    rank = tl.sum(before.to(tl.int32), axis=1)
    base = tl.load(start_ptr + ids, mask=valid, other=0) + tl.load(counts_ptr + c * E + ids, mask=valid, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=valid)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids [T, k] (int32 or int64, values in 0..E-1) -> `MoeAlignment`, as `moe_align_ref`; block_m a power
    of two >= 16 (the GEMMs' row tile)."""
    check_device(topk_ids)
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be an int32/int64 [T, k] tensor, got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    ids = topk_ids.contiguous().view(-1)
    n = ids.numel()
    size = moe_align_size(n, num_experts, block_m)
    num_blocks = size // block_m
    dev = ids.device
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    chunks = max(triton.cdiv(n, CHUNK), 1)
    counts = torch.empty(chunks, num_experts, dtype=torch.int32, device=dev)
    start = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    fill = triton.cdiv(triton.cdiv(size, chunks), CHUNK) * CHUNK
    _count_kernel[(chunks,)](ids, counts, sorted_pairs, n, num_experts, size, fill, CHUNK=CHUNK, E_TILE=E_TILE,
                             num_warps=4)
    block_e = triton.next_power_of_2(num_experts)
    _offsets_kernel[(1,)](counts, start, chunks, num_experts, BLOCK_M=block_m, BLOCK_C=max(1, 4096 // block_e),
                          BLOCK_E=block_e, num_warps=4)
    _scatter_kernel[(chunks,)](ids, counts, start, sorted_pairs, block_expert, n, num_experts, chunks, num_blocks,
                               CHUNK=CHUNK, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_B=max(1, 4096 // block_e),
                               num_warps=4)
    return MoeAlignment(sorted_pairs, block_expert, block_m)
