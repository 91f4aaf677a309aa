"""The gated RMSNorm of Gated DeltaNet's output (`gated_delta.gated_rms_norm_ref`'s contract) in Triton.

Math per row of D features: y = (w * round(x / sqrt(mean(x^2) + eps))) * silu(gate), with the reference's roundings:
the normed row to x's dtype, its product with w to the promoted dtype of (w, x), the gate's silu and the last
product in fp32, the result to x's dtype. Shapes: x, gate [..., D] (rows of Dv = 128 in the model), w [D].
Traffic: 3 * rows * D elements (read x and gate, write y), pure bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.gated_delta import gated_rms_norm_ref
from orinfer.kernels.gemv import TL_DTYPES, check_device
from orinfer.kernels.norm import MAX_FEATURES, _rows_view



@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, n_rows, n_inner, eps, stride_xo, stride_xi, stride_go,
                           stride_gi, H: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                           PROD_TY: tl.constexpr):
    """ROWS rows a program, each held whole in registers. Grid (cdiv(rows, ROWS),)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    rows = tl.minimum(rows, n_rows - 1).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    mask = row_mask[:, None] & col_mask[None, :]
    x_off = ((rows // n_inner) * stride_xo + (rows % n_inner) * stride_xi)[:, None] + cols[None, :]
    g_off = ((rows // n_inner) * stride_go + (rows % n_inner) * stride_gi)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps)
    y = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = (w[None, :] * y).to(PROD_TY).to(tl.float32)
    y = y * (g / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`gated_rms_norm_ref`'s contract: x, gate [..., D] (same shape; unit last stride, 2- or 3-level strided views
    read in place), weight [D] -> new contiguous [..., D] in x's dtype.

    Kernel: grid (cdiv(rows, ROWS),); a program normalises ROWS rows of next_pow2(D) features (16 rows of 128 for
    the model's Dv), fp32 sum of squares.
    """
    check_device(x)
    h = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (h,):
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight "
                         f"{tuple(weight.shape)} do not match")
    prod = torch.promote_types(weight.dtype, x.dtype)
    if h > MAX_FEATURES or x.numel() == 0 or prod not in TL_DTYPES:
        return gated_rms_norm_ref(x, gate, weight, eps)
    weight = weight.contiguous()
    xv, n_rows, n_inner, sxo, sxi = _rows_view(x)
    gv, _, _, sgo, sgi = _rows_view(gate)  # same shape as x: the same row numbering
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_h = triton.next_power_of_2(h)
    rows_per_prog = max(1, min(16, 2048 // block_h))
    _gated_rms_norm_kernel[(triton.cdiv(n_rows, rows_per_prog),)](
        xv, gv, weight, out, n_rows, n_inner, eps, sxo, sxi, sgo, sgi, H=h, ROWS=rows_per_prog, BLOCK_H=block_h,
        PROD_TY=TL_DTYPES[prod], num_warps=max(1, min(16, rows_per_prog * block_h // 512)))
    return out
