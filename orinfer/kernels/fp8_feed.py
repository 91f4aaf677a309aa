"""FP8 activation feeding: the kernel that produces a W8A8 linear's input x also quantizes it (`Fp8Act`), so that the
linear's own quantize launch (`fp8_quantize_act`, ~2 us per linear at 64 rows on an H200) and the 16-bit round trip
of x disappear. Two producers, each bit-exact against its unfused pair (same kernels' arithmetic through the shared
@triton.jit helpers `norm.normed_rows`, `activation.silu_mul` and `fp8_quant.quantize_groups`):

`rms_norm_fp8(x, w, eps, residual, group)` = `fp8_quantize_act(rms_norm(x, w, eps, residual), group)`:
  r' = x + r rounded to x's dtype (stored: the new residual), h = (w * round(r' / sqrt(mean(r'^2) + eps))) rounded
  to x's dtype (w may be fp32: zero-centred norms), then per row and group of `group` inputs s = amax |h| / 448 (1 for
  an all-zero group) and q = e4m3(h * (1 / s)). x, r [..., H] -> Fp8Act(q [M_pad, H], s [M_pad, Kb]) and r' [..., H].
  Kernel: `rms_norm`'s grid, rows a program and warps (`norm.launch_shape`), over M_pad rows (padding rows: zeros,
  scale 1). Traffic per row: read x, r (4H bytes in 16-bit), write r' (2H), q (H) and H/32 of scales, against
  4H + 4H for `rms_norm` then 2H + H + H/32 for `fp8_quantize_act` (Qwen3-8B, 64 rows: 1.8 MB instead of 2.6 MB, and
  one launch instead of two).

`silu_and_mul_fp8(gate_up, group)` = `fp8_quantize_act(silu_and_mul(gate_up), group)`: [..., 2I] = [g | u] ->
  Fp8Act of silu(g) * u [..., I] (silu(g) rounded to the dtype before the product, as `silu_and_mul`). Kernel: grid
  (M_pad / 4, cdiv(Kb, GROUPS)), as `fp8_quantize_act`'s: a program reads 4 rows x GROUPS groups of g and u, writes
  their codes and scales. Traffic per row: read 4I bytes, write I + I/32, against 4I + 2I then 2I + I + I/32
  (Qwen3-8B, I = 12288, 64 rows: 3.9 MB instead of 7.1 MB).

The layout is `fp8_quantize_act`'s (fp8_quant.py): what `fp8_gemm` (scale[:M]) and `fp8_ops.fp8_scaled_mm` (all
M_pad rows, stride(0) == 1) take. The references (`*_ref`) compose the torch references the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.activation import silu_and_mul_ref, silu_mul
from orinfer.kernels.fp8_block import fp8_quantize_act_ref
from orinfer.kernels.fp8_quant import (Fp8Act, act_buffers, check_group, fp8_quantize_act, group_grid,
                                       quantize_groups)
from orinfer.kernels.gemv import check_device
from orinfer.kernels.norm import MAX_FEATURES, _rows_view, launch_shape, normed_rows, rms_norm, rms_norm_ref
from orinfer.kernels.pdl import small_kernel_prologue, use_pdl


def fp8_act_ref(x: torch.Tensor, group: int) -> Fp8Act:
    """`fp8_quantize_act_ref` of x [..., K] in `fp8_quantize_act`'s padded layout, as an Fp8Act."""
    k = x.shape[-1]
    q, s = fp8_quantize_act_ref(x.reshape(-1, k), group)
    q_pad, s_pad = act_buffers(q.shape[0], k, group, x.device)
    q_pad.view(torch.uint8).zero_()
    s_pad.fill_(1.0)
    q_pad[:q.shape[0]] = q
    s_pad.t()[:s.shape[0]] = s
    return Fp8Act(q_pad, s_pad.t(), x.dtype, tuple(x.shape))


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                     group: int = 128) -> Fp8Act | tuple[Fp8Act, torch.Tensor]:
    """`rms_norm_ref`, then its output quantized (`fp8_act_ref`)."""
    out = rms_norm_ref(x, weight, eps, residual)
    if residual is None:
        return fp8_act_ref(out, group)
    return fp8_act_ref(out[0], group), out[1]


def silu_and_mul_fp8_ref(gate_up: torch.Tensor, group: int = 128) -> Fp8Act:
    """`silu_and_mul_ref`, then its output quantized (`fp8_act_ref`)."""
    return fp8_act_ref(silu_and_mul_ref(gate_up), group)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, r_ptr, w_ptr, res_out_ptr, q_ptr, s_ptr, n_rows, m_pad, n_inner, eps,
                         stride_xo, stride_xi, stride_ro, stride_ri, stride_qm, stride_sg,
                         H: tl.constexpr, HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                         G: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py
        small_kernel_prologue()
    first = tl.program_id(0) * ROWS
    normed, _, _ = normed_rows(x_ptr, r_ptr, w_ptr, res_out_ptr, first, n_rows, n_inner, eps, stride_xo, stride_xi,
                               stride_ro, stride_ri, H, HAS_RES, ROWS, BLOCK_H)
    h = normed.to(x_ptr.dtype.element_ty).to(tl.float32)   # the normed row as `rms_norm` stores it
    # Groups of G inputs (G = the group, or BLOCK_H when a row is narrower: then it is the row's only group).
    q, s = quantize_groups(tl.reshape(h, (ROWS, BLOCK_H // G, G)))
    rows = (first + tl.arange(0, ROWS)).to(tl.int64)
    g = tl.arange(0, BLOCK_H // G)
    ks = g[:, None] * G + tl.arange(0, G)[None, :]                          # [groups, G]
    live = rows[:, None, None] < m_pad                                      # padding rows: zeros, scale 1
    tl.store(q_ptr + rows[:, None, None] * stride_qm + ks[None, :, :], q.to(tl.float8e4nv),
             mask=live & (ks < H)[None, :, :])
    tl.store(s_ptr + g[None, :] * stride_sg + rows[:, None], s,
             mask=(rows[:, None] < m_pad) & (g < tl.cdiv(H, G))[None, :])


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 group: int = 128) -> Fp8Act | tuple[Fp8Act, torch.Tensor]:
    """`rms_norm` whose normed row comes quantized for a W8A8 linear (module docstring): an Fp8Act of the normed
    x [..., H] in groups of `group` (a power of two >= 16), and the new residual when one is given."""
    check_device(x)
    check_group(group)
    h = x.shape[-1]
    if weight.shape != (h,) or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype)):
        raise ValueError(f"rms_norm_fp8: x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual "
                         f"{None if residual is None else (tuple(residual.shape), residual.dtype)} do not match")
    if h > MAX_FEATURES or x.numel() == 0:                  # what rms_norm runs as its reference
        out = rms_norm(x, weight, eps, residual)
        normed = out if residual is None else out[0]
        q, s = fp8_quantize_act(normed.reshape(-1, h), group)
        act = Fp8Act(q, s, x.dtype, tuple(x.shape))
        return act if residual is None else (act, out[1])
    weight = weight.contiguous()
    xv, n_rows, n_inner, sxo, sxi = _rows_view(x)
    if residual is not None:
        rv, _, _, sro, sri = _rows_view(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        rv, sro, sri, res_out = xv, 0, 0, xv                # never written (HAS_RES False)
    q, s = act_buffers(n_rows, h, group, x.device)
    block_h, rows_per_prog, num_warps = launch_shape(h)
    pdl = use_pdl(x)
    _rms_norm_fp8_kernel[(triton.cdiv(q.shape[0], rows_per_prog),)](
        xv, rv, weight, res_out, q, s, n_rows, q.shape[0], n_inner, eps, sxo, sxi, sro, sri, q.stride(0), s.stride(0),
        H=h, HAS_RES=residual is not None, ROWS=rows_per_prog, BLOCK_H=block_h, G=min(group, block_h), PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl)
    act = Fp8Act(q, s.t(), x.dtype, tuple(x.shape))
    return act if residual is None else (act, res_out)


@triton.jit
def _silu_and_mul_fp8_kernel(gu_ptr, q_ptr, s_ptr, M, inter, stride_gm, stride_qm, stride_sg, G: tl.constexpr,
                             ROWS: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py
        small_kernel_prologue()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    ks = g[:, None] * G + tl.arange(0, G)[None, :]                          # [GROUPS, G]
    r3 = rows.to(tl.int64)[:, None, None]
    mask = (ks < inter)[None, :, :] & (r3 < M)                             # padding rows read zeros: silu(0) 0 = 0
    gate_ptrs = gu_ptr + r3 * stride_gm + ks[None, :, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    h = silu_mul(gate, up, gu_ptr.dtype.element_ty).to(tl.float32)
    q, s = quantize_groups(h)
    tl.store(q_ptr + r3 * stride_qm + ks[None, :, :], q.to(tl.float8e4nv), mask=(ks < inter)[None, :, :])
    tl.store(s_ptr + g.to(tl.int64)[None, :] * stride_sg + rows[:, None], s, mask=(g < tl.cdiv(inter, G))[None, :])


def silu_and_mul_fp8(gate_up: torch.Tensor, group: int = 128) -> Fp8Act:
    """`silu_and_mul` whose output comes quantized for a W8A8 linear (module docstring): gate_up [..., 2I] (16-bit,
    last dim contiguous) -> an Fp8Act of silu(g) * u [..., I] in groups of `group`."""
    check_device(gate_up)
    check_group(group)
    two_i = gate_up.shape[-1]
    if two_i % 2 or gate_up.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"silu_and_mul_fp8 takes a 16/32-bit [..., 2I], got {tuple(gate_up.shape)} {gate_up.dtype}")
    inter = two_i // 2
    g2 = gate_up.reshape(-1, two_i)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    m = g2.shape[0]
    q, s = act_buffers(m, inter, group, gate_up.device)
    if m and inter:
        grid, groups = group_grid(q.shape[0], s.shape[0], group)
        pdl = use_pdl(g2)
        _silu_and_mul_fp8_kernel[grid](g2, q, s, m, inter, g2.stride(0), q.stride(0), s.stride(0), G=group, ROWS=4,
                                       GROUPS=groups, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return Fp8Act(q, s.t(), gate_up.dtype, (*gate_up.shape[:-1], inter))

