"""One-row INT4 GEMV over the W4 layout (`kernels.w4`): decode at batch 1, optionally fused with gate/up + SwiGLU.

Math: y[n] = sum_g s[n, g] * (sum_{k in g} q[n, k] x[k]  -  z[n, g] * sum_{k in g} x[k]) (+ b[n]), fp32 throughout,
rounded once to x's dtype (fp16 clamped to +-65504). Zero points and scales leave the per-weight work: each weight
costs one AND/OR, one FADD and one FMA.

Per weight, without an int->float convert: nibble p is masked in place (the int32, or the int32 shifted right by 16
for p >= 4) and OR-ed into the bits of 2^23, which reads as the fp32 2^23 + q * 16^(p % 4); subtracting 2^23 is
exact. x for nibble p is pre-multiplied by 16^-(p % 4) (exact), so the products are q * x.

Grid (cdiv(N, BLOCK_N),): a program owns BLOCK_N output rows and walks all of K in [BLOCK_N, BLOCK_KP] int32 tiles
(BLOCK_KP * 4 contiguous bytes per row: long coalesced runs, as the dense GEMV reads W [N, K]); occupancy (many
small programs per SM) keeps enough bytes in flight. No split-K, no workspace, one launch. Traffic: N*K/2 bytes of
weights + N*K/G*3 of scales and zeros + K*2 of x (from L2) -> the target time is N*K*(0.5 + 3/G) / HBM bandwidth.
GATED (packed gate_up [2I, K/8], gate rows first): a program also reads the up rows I + n and writes silu(g) * u
with g and u rounded to the activation dtype first, as the unfused GEMV + `silu_and_mul` do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.w4 import W4Weight


@triton.jit
def _round_to(v, out_ty: tl.constexpr, CLAMP16: tl.constexpr):
    if CLAMP16:
        v = tl.minimum(tl.maximum(v, -65504.0), 65504.0)
    return v.to(out_ty)


@triton.jit
def _epilogue(g, u, bias, out_ty: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
              CLAMP16: tl.constexpr):
    """fp32 sums -> stored values: + bias, or SwiGLU with the unfused path's roundings (g, u and silu(g) rounded to
    the activation dtype, as GEMM + `silu_and_mul` do); fp16 clamped to +-65504."""
    if HAS_BIAS:
        g += bias
    if GATED:
        g = _round_to(g, out_ty, CLAMP16).to(tl.float32)
        u = _round_to(u, out_ty, CLAMP16).to(tl.float32)
        s = _round_to(g / (1.0 + tl.exp(-g)), out_ty, CLAMP16).to(tl.float32)
        g = s * u
    return _round_to(g, out_ty, CLAMP16)


@triton.jit
def _nibble_times_16p(w, w_hi, P: tl.constexpr):
    """q * 16^(P % 4) as fp32 (exact) for nibble P of each int32 of `w` (`w_hi` = w >> 16)."""
    word = w if P < 4 else w_hi
    bits = (word & (15 << (4 * (P % 4)))) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _row_tile_dot(w, x_ptr, kbase, G8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
                  R: tl.constexpr, GPT: tl.constexpr, SUB: tl.constexpr):
    """(per-group dots [BLOCK_N, GPT] of the tile's codes with x, per-group sums of x [GPT])."""
    w_hi = w >> 16
    d = tl.zeros([BLOCK_N, BLOCK_KP], dtype=tl.float32)
    xs = tl.zeros([BLOCK_KP], dtype=tl.float32)
    for p in tl.static_range(8):
        xp = tl.load(x_ptr + kbase + p * R).to(tl.float32)
        xs += xp
        if p % 4 == 1:
            xp = xp * 0.0625
        elif p % 4 == 2:
            xp = xp * 0.00390625
        elif p % 4 == 3:
            xp = xp * 0.000244140625
        d += _nibble_times_16p(w, w_hi, p) * xp[None, :]
    dg = tl.sum(tl.reshape(d, (BLOCK_N, GPT, SUB)), axis=2)
    xg = tl.sum(tl.reshape(xs, (GPT, SUB)), axis=1)
    return dg, xg


@triton.jit
def _w4_gemv_kernel(x_ptr, qw_ptr, sc_ptr, zp_ptr, b_ptr, out_ptr, N_OUT, K8, stride_qw, stride_sg, UP,
                    G8: tl.constexpr, R: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                    CLAMP16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, GPT: tl.constexpr,
                    SUB: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ld = tl.minimum(rows, N_OUT - 1).to(tl.int64)               # tail rows: computed twice, never stored
    cols = tl.arange(0, BLOCK_KP)
    groups = tl.arange(0, GPT)
    acc_g = tl.zeros([BLOCK_N, GPT], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, GPT], dtype=tl.float32)
    for c0 in range(0, K8, BLOCK_KP):
        c = c0 + cols
        kbase = (c // R) * (8 * R) + c % R                         # input index of nibble 0 of int32 column c
        grp = c0 // G8 + groups                                    # (GPT == 1: the one group of a sub-group tile)
        w = tl.load(qw_ptr + r_ld[:, None] * stride_qw + c[None, :], eviction_policy="evict_first")
        dg, xg = _row_tile_dot(w, x_ptr, kbase, G8, BLOCK_N, BLOCK_KP, R, GPT, SUB)
        sg = r_ld[:, None] * stride_sg + grp[None, :]
        s = tl.load(sc_ptr + sg).to(tl.float32)
        z = tl.load(zp_ptr + sg).to(tl.float32)
        acc_g += s * (dg - z * xg[None, :])
        if GATED:
            w = tl.load(qw_ptr + (r_ld + UP)[:, None] * stride_qw + c[None, :], eviction_policy="evict_first")
            dg, xg = _row_tile_dot(w, x_ptr, kbase, G8, BLOCK_N, BLOCK_KP, R, GPT, SUB)
            s = tl.load(sc_ptr + sg + UP * stride_sg).to(tl.float32)
            z = tl.load(zp_ptr + sg + UP * stride_sg).to(tl.float32)
            acc_u += s * (dg - z * xg[None, :])
    if PDL:
        gdc_launch_dependents()
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + r_ld).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows, _epilogue(g, u, bias, out_ty, HAS_BIAS, GATED, CLAMP16), mask=rows < N_OUT)


class W4GemvConfig(NamedTuple):
    block_n: int     # output rows per program
    block_kp: int    # int32 per row per step (8 * block_kp inputs)
    num_warps: int


# From the cold-weight graph-replay sweep of scripts/w4_sweep.py on the H200 (benchmarks/NOTES.md run 23): the
# fastest or within 3% of it on all four Qwen3-8B projections.
DEFAULT_GEMV = W4GemvConfig(4, 512, 4)
GEMV_CONFIGS = [W4GemvConfig(bn, kp, w) for bn, kp, w in
                [(1, 512, 2), (2, 512, 2), (2, 256, 2), (4, 256, 4), (4, 512, 4), (2, 1024, 4), (8, 128, 4),
                 (4, 128, 2), (8, 256, 4), (1, 1024, 4), (2, 512, 4), (16, 128, 4)]]


def _tile_groups(k8: int, g8: int, r: int, block_kp: int) -> tuple[int, int, int]:
    """(int32 per row per step, groups per tile, int32 per group-slice): the largest power of two <= block_kp that
    divides K/8 and either holds whole groups or divides one (every tile then sees whole chunks of R int32)."""
    kp = 1 << (block_kp.bit_length() - 1)
    while kp > r and (k8 % kp or (kp % g8 if kp > g8 else g8 % kp)):
        kp //= 2
    if k8 % kp or (kp % g8 if kp > g8 else g8 % kp) or kp % r:
        raise ValueError(f"no W4 GEMV tile fits K={8 * k8} with group size {8 * g8}")
    return (kp, kp // g8, g8) if kp >= g8 else (kp, 1, kp)


def w4_gemv(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None, gated: bool = False,
            cfg: W4GemvConfig | None = None) -> torch.Tensor:
    """One row: x [..., K] (one row in all) -> [..., N] (gated: [..., N/2] = silu(gate) * up) in x's dtype."""
    check_device(x)
    k, n = w.in_features, w.out_features
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"w4_gemv takes one row of {k} inputs, got x {tuple(x.shape)}")
    n_out = n // 2 if gated else n
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n_out} outputs")
    cfg = cfg or DEFAULT_GEMV
    g8, r = w.group_size // 8, w.chunk_int32
    block_kp, gpt, sub = _tile_groups(k // 8, g8, r, cfg.block_kp)
    x1 = x.reshape(k).contiguous()
    out = torch.empty(n_out, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x1)
    _w4_gemv_kernel[(triton.cdiv(n_out, cfg.block_n),)](
        x1, w.packed, w.scales, w.zeros, bias if bias is not None else out, out, n_out, k // 8,
        w.packed.stride(0), w.scales.stride(0), n_out if gated else 0, G8=g8, R=r, HAS_BIAS=bias is not None,
        GATED=gated, CLAMP16=x.dtype == torch.float16, BLOCK_N=cfg.block_n, BLOCK_KP=block_kp, GPT=gpt, SUB=sub,
        PDL=pdl, num_warps=cfg.num_warps, launch_pdl=pdl)
    return out.reshape(*x.shape[:-1], n_out)
