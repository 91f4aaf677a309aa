"""RMSNorm, optionally fused with the residual add that precedes it.

Math (per row of H features, fp32 inside): r' = x + r (rounded to the activation dtype, as the unfused model does),
y = w * (r' / sqrt(mean(r'^2) + eps)). Shapes: x, r [T, H]; w [H]. Returns y (and r' when a residual is given).
Traffic of a fused kernel: read x, r, w; write y, r' -> about 4*T*H elements, versus 6 for add + norm separately.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from orinfer.kernels.pdl import small_kernel_prologue, use_pdl

from orinfer.kernels.gemv import check_device

MAX_FEATURES = 65536  # one row lives in registers; wider rows fall back to the reference


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch RMSNorm (+ residual add), matching HF's Qwen2RMSNorm rounding step for step."""
    if residual is not None:
        x = x + residual
        residual = x
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * y.to(x.dtype)
    if out.dtype != x.dtype:  # mixed mode: 16-bit weight, fp32 activations stay fp32
        out = out.to(x.dtype)
    return out if residual is None else (out, residual)


@triton.jit
def normed_rows(x_ptr, r_ptr, w_ptr, res_out_ptr, first_row, n_rows, n_inner, eps, stride_xo, stride_xi, stride_ro,
                stride_ri, H: tl.constexpr, HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """(w * (r' / rms(r')) in fp32 [ROWS, BLOCK_H], the rows' offsets in a contiguous [n_rows, H] output, its mask)
    for rows first_row .. + ROWS (module docstring; r' = x + r stored to res_out_ptr when HAS_RES, else x). Rows past
    n_rows and columns past H read as zeros and give zeros. `rms_norm` and the FP8-feeding norm
    (kernels/fp8_feed.py) both normalise through this, so that their sums of squares are reduced alike."""
    rows = first_row + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    rows = tl.minimum(rows, n_rows - 1).to(tl.int64)
    outer = rows // n_inner
    inner = rows % n_inner
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    mask = row_mask[:, None] & col_mask[None, :]
    act_ty = x_ptr.dtype.element_ty
    x_off = (outer * stride_xo + inner * stride_xi)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    # w is loaded before the residual store: the compiler cannot tell them apart, so a load after it would wait for
    # the inputs' round trip to memory before starting its own.
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dense = rows[:, None] * H + cols[None, :]  # outputs are contiguous [n_rows, H]
    if HAS_RES:
        r_off = (outer * stride_ro + inner * stride_ri)[:, None] + cols[None, :]
        r = tl.load(r_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(act_ty)  # the new residual, rounded like the unfused add
        tl.store(res_out_ptr + dense, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps)
    y = (x * rstd[:, None]).to(act_ty).to(tl.float32)
    return w[None, :] * y, dense, mask


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, n_inner, eps,
                     stride_xo, stride_xi, stride_ro, stride_ri,
                     H: tl.constexpr, HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # see kernels/pdl.py: wait for the previous kernel before touching memory
        small_kernel_prologue()
    out, dense, mask = normed_rows(x_ptr, r_ptr, w_ptr, res_out_ptr, tl.program_id(0) * ROWS, n_rows, n_inner, eps,
                                   stride_xo, stride_xi, stride_ro, stride_ri, H, HAS_RES, ROWS, BLOCK_H)
    tl.store(out_ptr + dense, out.to(out_ptr.dtype.element_ty), mask=mask)


def launch_shape(h: int) -> tuple[int, int, int]:
    """(BLOCK_H, rows a program, warps) of `rms_norm`'s kernel for rows of h features (kernels reducing through
    `normed_rows` launch alike, so their reductions are the same)."""
    block_h = triton.next_power_of_2(h)
    rows_per_prog = max(1, min(16, 2048 // block_h))
    return block_h, rows_per_prog, max(1, min(16, rows_per_prog * block_h // 512))


def _rows_view(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """t [..., H] with unit last stride as (tensor, n_rows, n_inner, stride_outer, stride_inner): row i lives at
    (i // n_inner) * stride_outer + (i % n_inner) * stride_inner. Two levels cover [T, H] and strided [T, heads, D]
    views (q/k heads inside a packed qkv row) without a copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() > 3:
        t = t.reshape(-1, t.shape[-2], t.shape[-1])
    if t.dim() == 2:
        return t, t.shape[0], 1, t.stride(0), 0
    return t, t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm (+ fused residual add) with `rms_norm_ref`'s signature and rounding.

    x [..., H] (any leading dims, last dim contiguous; strided 3-D views are read in place), weight [H]; residual
    like x. Out of place: returns a new contiguous out (and a new contiguous residual); x and residual are never
    written. Kernel: grid (cdiv(rows, ROWS),); a program normalises ROWS rows of BLOCK_H = next_pow2(H) features
    held in registers (ROWS = 1 for H >= 2048, more for per-head norms of D = 64/128); fp32 sum of squares.
    Traffic: rows*H*(2 + 2*has_residual) elements + H.
    """
    check_device(x)
    h = x.shape[-1]
    if weight.shape != (h,) or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype)):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual "
                         f"{None if residual is None else (tuple(residual.shape), residual.dtype)} do not match")
    if h > MAX_FEATURES or x.numel() == 0:
        return rms_norm_ref(x, weight, eps, residual)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    xv, n_rows, n_inner, sxo, sxi = _rows_view(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        rv, _, _, sro, sri = _rows_view(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        rv, sro, sri, res_out = xv, 0, 0, out
    block_h, rows_per_prog, num_warps = launch_shape(h)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows_per_prog),)](
        xv, rv, weight, out, res_out, n_rows, n_inner, eps, sxo, sxi, sro, sri,
        H=h, HAS_RES=residual is not None, ROWS=rows_per_prog, BLOCK_H=block_h, num_warps=num_warps,
        PDL=use_pdl(x), launch_pdl=use_pdl(x))
    return out if residual is None else (out, res_out)
