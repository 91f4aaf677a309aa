"""FP8 block-wise weight -> 16-bit weight, for prefill through cuBLAS where no FP8 GEMM beats it (fp8_ops.py,
PREFILL = "dequant").

Math: W[n, k] = q[n, k] * s[row(n), k // bk] in fp32 (exact for e4m3 values; one rounding of the product), rounded
once to the output dtype: `fp8_block_dequantize_ref(..., dtype)` bit for bit. row(n) = row_block[n], or n // bn.

Shapes: q [N, K] float8_e4m3fn row-major, s [rows, ceil(K / bk)] fp32 -> W [N, K] bf16/fp16/fp32. Grid (cdiv(N, 32),
cdiv(K, 256)): a program converts a 32 x 256 tile. Bandwidth-bound: 1 byte read + 2 written per weight (Qwen3-8B's
gate_up, 96 MB of FP8: ~290 MB moved, ~0.1 ms on an H100), against a bf16 GEMM of 2048 rows on it of ~0.5 ms.

8-bit integer codes (W8, `kernels/w8.py`; `zeros` given): q uint8, W[n, k] = (q - z) * s of its (row, group), bn = 1,
bk = the group size, fp16 or fp32 s and z (or one z for all): `w8_dequantize_ref` bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.fp8_gemv import _scale_rows, check_fp8_weight
from orinfer.kernels.gemv import check_device
from orinfer.kernels.tiles import UINT8, code_args, code_values, zero_offsets

_TILE_N, _TILE_K = 32, 256


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, z_ptr, rb_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_on, BN: tl.constexpr,
                    BK: tl.constexpr, CODES: tl.constexpr, ZERO: tl.constexpr, HAS_RB: tl.constexpr,
                    TILE_N: tl.constexpr, TILE_K: tl.constexpr):
    rows = tl.program_id(0) * TILE_N + tl.arange(0, TILE_N)
    cols = tl.program_id(1) * TILE_K + tl.arange(0, TILE_K)
    rmask = rows < N
    mask = rmask[:, None] & (cols < K)[None, :]
    srow = _scale_rows(rb_ptr, tl.where(rmask, rows, 0), BN, HAS_RB)
    s_offs = srow[:, None] * stride_sn + (cols // BK)[None, :]
    s = tl.load(s_ptr + s_offs, mask=mask, other=1.0).to(tl.float32)
    zoff = 0.0
    if CODES == UINT8:
        zoff = zero_offsets(z_ptr + s_offs, mask, ZERO)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qn + cols[None, :], mask=mask, other=0.0)
    w = code_values(q, zoff, CODES) * s
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_on + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask)


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                   row_block: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                   zeros: torch.Tensor | int | None = None) -> torch.Tensor:
    """W [N, K] in `dtype` from the FP8 weight [N, K] and its block scales (module docstring); with `zeros`, from uint8
    codes and their zero points (or one zero point for all)."""
    check_device(weight)
    n, k = weight.shape
    check_fp8_weight(weight, scale, block_size, row_block, k, zeros=zeros)
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    if n and k:
        rb = row_block if row_block is not None else scale     # any pointer: unused without a row map
        _dequant_kernel[(triton.cdiv(n, _TILE_N), triton.cdiv(k, _TILE_K))](
            weight, scale, zeros if isinstance(zeros, torch.Tensor) else scale, rb, out, n, k, weight.stride(0),
            scale.stride(0), out.stride(0), BN=block_size[0], BK=block_size[1], **code_args(zeros),
            HAS_RB=row_block is not None, TILE_N=_TILE_N, TILE_K=_TILE_K, num_warps=4)
    return out
