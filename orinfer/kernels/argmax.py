"""Greedy sampling's argmax over the vocabulary, for the decode graphs.

Math: ids[b] = the first index of the largest logits[b, v], a NaN counting as larger than everything (what
torch.argmax returns). Two kernels:
  * stage 1, grid (B, cdiv(V, CHUNK)): each program reduces CHUNK logits of a row to its (largest value, first
    index of it), or (NaN, first NaN's index) when the chunk holds a NaN;
  * stage 2, grid (B,): reduces a row's partials in chunk order; the first chunk holding the winning value (or the
    first NaN) wins, so its index is the row's first occurrence.
Traffic: B*V logits read once (just written by the lm_head, so mostly from L2) plus 8 bytes per partial; the ids are
stored as int64 wherever `out` points (the decode graphs' input ids row), and optionally once more into a row of a
`mirror` chosen by a device-side index: the decode graphs' pinned host buffer, so that the host reads the ids with
no device-to-host copy behind the replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device
from orinfer.kernels.pdl import small_kernel_prologue, use_pdl

CHUNK = 4096  # logits per stage-1 program: 38 programs per row of Qwen's 151936


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: torch.argmax over the last dimension."""
    return torch.argmax(logits, dim=-1)


@triton.jit
def _argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, n_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see kernels/pdl.py: wait for the previous kernel before touching memory
        small_kernel_prologue()
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    x = tl.load(x_ptr + b.to(tl.int64) * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan, offs, V), axis=0)
    x = tl.where(is_nan, float("-inf"), x)
    best = tl.max(x, axis=0)
    first_best = tl.min(tl.where((x == best) & mask, offs, V), axis=0)
    has_nan = first_nan < V
    part = b * n_chunks + c
    tl.store(val_ptr + part, tl.where(has_nan, float("nan"), best))
    tl.store(idx_ptr + part, tl.where(has_nan, first_nan, first_best))


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, n_chunks, stride_out, mirror_ptr, mirror_row_ptr, stride_mirror,
                         BLOCK_P: tl.constexpr, MIRROR: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see kernels/pdl.py: wait for the previous kernel before touching memory
        small_kernel_prologue()
    b = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    p_mask = p < n_chunks
    vals = tl.load(val_ptr + b * n_chunks + p, mask=p_mask, other=float("-inf"))
    idxs = tl.load(idx_ptr + b * n_chunks + p, mask=p_mask, other=0)
    is_nan = vals != vals
    first_nan = tl.min(tl.where(is_nan, p, BLOCK_P), axis=0)
    vals = tl.where(is_nan, float("-inf"), vals)
    best = tl.max(vals, axis=0)
    first_best = tl.min(tl.where((vals == best) & p_mask, p, BLOCK_P), axis=0)
    chunk = tl.where(first_nan < BLOCK_P, first_nan, first_best)
    best_id = tl.sum(tl.where(p == chunk, idxs, 0), axis=0).to(tl.int64)
    tl.store(out_ptr + b * stride_out, best_id)
    if MIRROR:
        tl.store(mirror_ptr + tl.load(mirror_row_ptr) * stride_mirror + b, best_id)


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None, chunk: int = CHUNK,
                mirror: torch.Tensor | None = None, mirror_row: torch.Tensor | None = None) -> torch.Tensor:
    """`argmax_rows_ref` for logits [B, V] (fp32 or 16-bit, unit last stride); writes the ids into `out` [B] int64
    (any stride) when given, and returns them. `chunk` (a power of two): logits per stage-1 program. No host sync:
    graph-capturable.

    `mirror` [R, >= B] int64 (rows contiguous; device memory, or pinned host memory, which the device writes
    directly) and `mirror_row` (an int64 tensor on the logits' device): the ids also go to mirror[mirror_row[0], :B],
    the row read when the kernel runs (so a captured graph can be pointed at another row between replays)."""
    check_device(logits)
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"argmax_rows: logits must be [B, V] with unit last stride, got {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if out.shape != (batch,) or out.dtype != torch.int64:
        raise ValueError(f"argmax_rows: out must be [{batch}] int64, got {tuple(out.shape)} {out.dtype}")
    if (mirror is None) != (mirror_row is None):
        raise ValueError("argmax_rows: mirror and mirror_row go together")
    if mirror is not None and (mirror.dim() != 2 or mirror.shape[1] < batch or mirror.stride(1) != 1
                               or mirror.dtype != torch.int64 or mirror_row.dtype != torch.int64):
        raise ValueError(f"argmax_rows: mirror must be [R, >= {batch}] int64 with contiguous rows and mirror_row "
                         f"int64, got {tuple(mirror.shape)} {mirror.dtype} and {mirror_row.dtype}")
    if batch == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax_rows: an empty vocabulary has no argmax")
    n_chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty(batch, n_chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(batch, n_chunks, dtype=torch.int32, device=logits.device)
    pdl = use_pdl(logits)
    _argmax_chunk_kernel[(batch, n_chunks)](logits, vals, idxs, vocab, logits.stride(0), n_chunks, CHUNK=chunk,
                                            num_warps=4, PDL=pdl, launch_pdl=pdl)
    mirrored = mirror is not None
    _argmax_merge_kernel[(batch,)](vals, idxs, out, n_chunks, out.stride(0), mirror if mirrored else out,
                                   mirror_row if mirrored else out, mirror.stride(0) if mirrored else 0,
                                   BLOCK_P=max(16, triton.next_power_of_2(n_chunks)), MIRROR=mirrored, num_warps=1,
                                   PDL=pdl, launch_pdl=pdl)
    return out
