"""Structured outputs' token masks applied to the logits: one launch for every constrained row of a step.

Math: for constrained row c (logits row rows[c]) and token v, logits[rows[c], v] = -inf unless bit v % 32 of word
v // 32 of bitmask[c] is set (ids at or beyond W * 32 are refused: the model's vocabulary may be wider than the
tokenizer's, whose masks the grammar library fills). Other rows are untouched.
Shapes: logits [B, V] (fp32 or 16-bit, unit last stride), rows [C] int64, bitmask [C, W] int32 (rows contiguous, as
llguidance fills it). Grid (C, cdiv(V, BLOCK)).
Traffic: per constrained row V logits read and written plus V / 8 bytes of mask; nothing for the other rows (the
torch reference materialises a [C, W, 32] int32 unpacking, ~40 MB at 64 rows of Qwen's 151,936).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device

BLOCK = 4096  # logits per program: 38 programs per row of Qwen's vocabulary


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[C, W] int32 token bitmask -> [C, vocab] bool, True where allowed (ids beyond W * 32 are not)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).to(torch.bool).reshape(bitmask.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed[:, :vocab]


def apply_token_bitmask_ref(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [B, V] with the disallowed tokens of rows `rows` set to -inf (other rows bit for bit)."""
    masked = logits.index_select(0, rows).masked_fill(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))
    return logits.index_copy(0, rows, masked)


@triton.jit
def _token_bitmask_kernel(logits_ptr, rows_ptr, mask_ptr, V, W, stride_l, stride_m, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < V
    word_idx = offs // 32
    words = tl.load(mask_ptr + c.to(tl.int64) * stride_m + word_idx, mask=in_row & (word_idx < W), other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    row = tl.load(rows_ptr + c)
    ptrs = logits_ptr + row * stride_l + offs
    # Through fp32 (exact both ways for 16-bit logits): the stored value is cast back to the logits' dtype.
    x = tl.load(ptrs, mask=in_row).to(tl.float32)
    tl.store(ptrs, tl.where(allowed, x, float("-inf")), mask=in_row)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                         block: int = BLOCK) -> torch.Tensor:
    """`apply_token_bitmask_ref` in place on `logits` (returned). No host sync: a step's sampler stays queued."""
    for t in (logits, rows, bitmask):
        check_device(t)
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [B, V] with unit last stride, got shape {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.stride(-1) != 1:
        raise ValueError(f"bitmask must be [C, W] int32 with unit last stride, got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    if rows.dim() != 1 or rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"rows must be [C] with C = {bitmask.shape[0]} (the bitmask's rows), got {tuple(rows.shape)}")
    count, vocab = bitmask.shape[0], logits.shape[1]
    if count:
        grid = (count, triton.cdiv(vocab, block))
        _token_bitmask_kernel[grid](logits, rows.to(torch.int64), bitmask, vocab, bitmask.shape[1],
                                    logits.stride(0), bitmask.stride(0), BLOCK=block)
    return logits
