"""Prototype (session 10, not used by the engine): a one-row W4 GEMV on mma.sync tensor cores, written in Gluon
(Triton's explicit-layout dialect) so that the operand layouts are ours, to A/B against `w4_gemv`.

A program owns BLOCK_N rows; its S warps split K (warp s takes chunks s, s + S, ...) as the batch dimension of a 3D
mma layout. Per chunk of 128 inputs: the [BLOCK_N, 16] int32 tile is unpacked in registers to eight bf16 operand
slices 128 + q (prmt + lop3, exact), multiplied with x's eight 16-input slices (x in column 0 of the 8-wide B
operand, zeros elsewhere), and the zero point comes back through the same MMA with an all-ones A: per row,
s * (sum (128 + q) x - (128 + z) sum x).

Why: `w4_gemv` spends ~3 SASS instructions per weight (one AND, one FMA, x and reduction work); this one compiles
to 1.9-2.3 (prmt + shift + lop3 per pair of weights, one HMMA per 256). Measured (run 104, scripts/w4_tc_ab.py and
scripts/gpu_session10.sh): correct (max relative error 3e-3, as the GEMV's), but slower: 52.3 us per Qwen3-8B layer
at the best tile per projection against 39.2, and the engine's batch-1 step 2.61 ms against 2.04. Each thread loads
8-byte pieces of 16 rows (the MMA operand layout over the W4 rows), and ptxas interleaves the loads with the MMAs
instead of keeping them in flight. A layout repacked for this operand (16 contiguous bytes per thread, as Marlin
does) would be the next thing to try.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from orinfer.kernels.w4 import W4Weight
from orinfer.kernels.w4_mma import _unpack_asm


# eight bf16 pairs (128 + q_p(k), 128 + q_p(k + 1)) per pair of int32 (inputs k, k + 1 of one row)
_UNPACK_MAGIC = gl.constexpr(_unpack_asm(0x43004300, 0x3F803F80, "bf16x2", subtract=False))


@gluon.jit
def _idx3(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, L: gl.constexpr):
    a = gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    b = gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    c = gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    return (gl.expand_dims(gl.expand_dims(a, 1), 2), gl.expand_dims(gl.expand_dims(b, 0), 2),
            gl.expand_dims(gl.expand_dims(c, 0), 1))


@gluon.jit
def _idx2(n0: gl.constexpr, n1: gl.constexpr, L: gl.constexpr):
    a = gl.arange(0, n0, layout=gl.SliceLayout(1, L))
    b = gl.arange(0, n1, layout=gl.SliceLayout(0, L))
    return gl.expand_dims(a, 1), gl.expand_dims(b, 0)


@gluon.jit
def _chunk(acc, w, xs, ones, zp_ptr, sc_ptr, sz):
    """acc + s * (sum_p (128 + q_p) x_p - (128 + z) sum x) for one chunk: the int32 tile `w`, x's eight slices `xs`
    (B operands), `ones` an all-ones A operand, `sz` the offsets of the chunk's scales and zero points."""
    planes = gl.inline_asm_elementwise(_UNPACK_MAGIC, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w],
                                       dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
    part = mma_v2(planes[0], xs[0], gl.zeros_like(acc))
    sx = mma_v2(ones, xs[0], gl.zeros_like(acc))
    for p in gl.static_range(1, 8):
        part = mma_v2(planes[p], xs[p], part)
        sx = mma_v2(ones, xs[p], sx)
    z = gl.load(zp_ptr + sz).to(gl.float32) + 128.0
    sc = gl.load(sc_ptr + sz).to(gl.float32)
    return acc + (part - gl.expand_dims(z, 2) * sx) * gl.expand_dims(sc, 2)


@gluon.jit
def _round16(v):
    return v.to(gl.bfloat16).to(gl.float32)


@gluon.jit
def w4_tc_gemv_kernel(x_ptr, qw_ptr, sc_ptr, zp_ptr, out_ptr, N_OUT, stride_qw, stride_sg, UP,
                      G8: gl.constexpr, S: gl.constexpr, BLOCK_N: gl.constexpr, STEPS: gl.constexpr,
                      GATED: gl.constexpr, PDL: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[S, 1, 1], instr_shape=[1, 16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    SM: gl.constexpr = gl.SliceLayout(2, MMA)
    pid = gl.program_id(0)
    row0 = pid * BLOCK_N
    sa, ra, ka = _idx3(S, BLOCK_N, 16, A_L)
    w_off = gl.minimum(row0 + ra, N_OUT - 1) * stride_qw + sa * 16 + ka      # chunk s of the row, int32 r
    ss, rs = _idx2(S, BLOCK_N, SM)
    s_row = gl.minimum(row0 + rs, N_OUT - 1) * stride_sg
    sb, kb, nb = _idx3(S, 16, 8, B_L)
    x_off = sb * 128 + kb + nb * 0                   # (+ nb * 0: broadcast to the operand's [S, 16, 8] shape)
    x_mask = (nb == 0) & (kb >= 0) & (sb >= 0)
    acc_g = gl.zeros([S, BLOCK_N, 8], gl.float32, MMA)
    acc_u = gl.zeros([S, BLOCK_N, 8], gl.float32, MMA)
    ones = gl.full([S, BLOCK_N, 16], 1.0, gl.bfloat16, A_L)
    if PDL:
        gdc_wait()
    # All of the program's loads written first (STEPS is small), so that a step's loads are not issued only after
    # the previous step's MMAs (run 103's order). ptxas still moves some of them between the MMAs (run 104's SASS).
    wgs = ()
    wus = ()
    xss = ()
    for i in gl.static_range(STEPS):
        c = i * S
        xp = x_ptr + x_off + c * 128
        xss = xss + ((gl.load(xp, mask=x_mask, other=0.0), gl.load(xp + 16, mask=x_mask, other=0.0),
                      gl.load(xp + 32, mask=x_mask, other=0.0), gl.load(xp + 48, mask=x_mask, other=0.0),
                      gl.load(xp + 64, mask=x_mask, other=0.0), gl.load(xp + 80, mask=x_mask, other=0.0),
                      gl.load(xp + 96, mask=x_mask, other=0.0), gl.load(xp + 112, mask=x_mask, other=0.0)),)
        wgs = wgs + (gl.load(qw_ptr + w_off + c * 16),)
        if GATED:
            wus = wus + (gl.load(qw_ptr + w_off + UP * stride_qw + c * 16),)
    for i in gl.static_range(STEPS):
        c = i * S
        sz = s_row + (c + ss) * 16 // G8
        acc_g = _chunk(acc_g, wgs[i], xss[i], ones, zp_ptr, sc_ptr, sz)
        if GATED:
            acc_u = _chunk(acc_u, wus[i], xss[i], ones, zp_ptr, sc_ptr, sz + UP * stride_sg)
    if PDL:
        gdc_launch_dependents()
    g = gl.sum(gl.sum(acc_g, axis=2), axis=0)
    if GATED:
        u = gl.sum(gl.sum(acc_u, axis=2), axis=0)
        g = _round16(g)
        g = _round16(g / (1.0 + gl.exp(-g))) * _round16(u)
    orows = row0 + gl.arange(0, BLOCK_N, layout=g.type.layout)
    gl.store(out_ptr + orows, g.to(gl.bfloat16), mask=orows < N_OUT)


def w4_tc_gemv(x: torch.Tensor, w: W4Weight, gated: bool = False, block_n: int = 32, warps: int = 4,
               pdl: bool = True) -> torch.Tensor:
    """One bf16 row x [K] -> [N] (gated: [N/2] = silu(gate) * up). Group size a multiple of 128."""
    k, n = w.in_features, w.out_features
    assert x.dtype == torch.bfloat16 and x.numel() == k and w.group_size % 128 == 0
    chunks = k // 128
    assert chunks % warps == 0, (chunks, warps)
    n_out = n // 2 if gated else n
    out = torch.empty(n_out, dtype=x.dtype, device=x.device)
    w4_tc_gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x.reshape(k), w.packed, w.scales, w.zeros, out, n_out, w.packed.stride(0), w.scales.stride(0),
        n_out if gated else 0, G8=w.group_size // 8, S=warps, BLOCK_N=block_n, STEPS=chunks // warps,
        GATED=gated, PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out.reshape(*x.shape[:-1], n_out)


def install(short: tuple[int, int] = (32, 4), long: tuple[int, int] = (32, 4)) -> None:
    """Route the engine's one-row bf16 W4 linears (w4_ops) through the prototype: `short` (block_n, warps) for rows
    of one step (K <= 4096), `long` for longer rows (down)."""
    from orinfer.kernels import w4_ops

    old = w4_ops.w4_gemv

    def routed(x, w, bias=None, gated=False, cfg=None):
        if bias is not None or x.dtype != torch.bfloat16 or w.group_size % 128:
            return old(x, w, bias, gated=gated, cfg=cfg)
        bn, warps = short if w.in_features <= 4096 else long
        return w4_tc_gemv(x, w, gated, bn, warps)

    w4_ops.w4_gemv = routed
