"""INT4 matmul on tensor cores over the W4 layout (`kernels.w4`): decode batches of 2..16 rows and prefill GEMMs.

Math: y [M, N] = x [M, K] W^T (+ b), W[n, k] = (q - z) * s per group. Per K step of one chunk (8R inputs, 128 for
G >= 128) a program loads x [BLOCK_M, 8R] and the int32 tile [BLOCK_N, R], unpacks it to the codes [BLOCK_N, 8R] in
k order (nibble p of int32 r is input p*R + r of the chunk), subtracts the zero point and multiplies on tensor cores:

    part = dot(x, (q - z)^T)      (q - z is an integer in -15..15: exact in bf16/fp16; fp32 accumulate)
    acc += part * s[group]        (per output column, once per chunk)

so no weight is rounded to 16 bits: up to summation order the result is the fp32 reference's, and the scale multiply
costs BLOCK_M * BLOCK_N per 8R-deep dot. fp32 x (CPU interpreter, mixed mode) uses an exact fp32 dot.
Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),) with grouped ordering over M (a band of GROUP_M row tiles walks the
columns together, so each weight tile is read from HBM about once per band). Rows beyond M repeat the last row and are
not stored; rows beyond N repeat the last row of W. GATED: the packed gate_up weight [2I, K/8]; a program multiplies
the gate rows n and the up rows I + n and stores silu(g) * u with awq.py's rounding (`_epilogue`).
Traffic: N*K*(0.5 + 3/G) weight bytes per band of BLOCK_M*GROUP_M rows + M*K*2 + M*N*2: bandwidth-bound at decode
sizes, compute-bound (2*M*N*K flops) for prefill.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device, interpreting
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.w4 import W4Weight
from orinfer.kernels.w4_gemv import _epilogue


@triton.jit
def _codes_minus_zero(w, z, BLOCK_N: tl.constexpr, R: tl.constexpr):
    """int32 tile [BLOCK_N, R] -> fp32 (q - z) [BLOCK_N, 8R] in the chunk's k order (z [BLOCK_N] fp32)."""
    shifts = tl.arange(0, 8) * 4
    codes = (w[:, None, :] >> shifts[None, :, None]) & 15                      # [BLOCK_N, 8, R]
    q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0          # exact, no int->float convert
    return tl.reshape(q, (BLOCK_N, 8 * R)) - z[:, None]


@triton.jit
def _chunk_dot(acc, xv, w_ptrs, sz_off, sc_ptr, zp_ptr, BLOCK_N: tl.constexpr, R: tl.constexpr,
               DOT_F32: tl.constexpr):
    w = tl.load(w_ptrs)
    z = tl.load(zp_ptr + sz_off).to(tl.float32)
    s = tl.load(sc_ptr + sz_off).to(tl.float32)
    q = _codes_minus_zero(w, z, BLOCK_N, R)
    if DOT_F32:
        part = tl.dot(xv, tl.trans(q), input_precision="ieee")
    else:
        part = tl.dot(xv, tl.trans(q.to(xv.dtype)))
    return acc + part * s[None, :]


@triton.jit
def _w4_mma_kernel(x_ptr, qw_ptr, sc_ptr, zp_ptr, b_ptr, out_ptr, M, N_OUT, K8, stride_xm, stride_om, stride_qw,
                   stride_sg, UP, G8: tl.constexpr, R: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                   DOT_F32: tl.constexpr, CLAMP16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   GROUP_M: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N_OUT, BLOCK_N)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    band_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_m
    pid_n = (pid % band) // band_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    rn = tl.minimum(offs_n, N_OUT - 1).to(tl.int64)
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, 8 * R)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]
    wg_ptrs = qw_ptr + rn[:, None] * stride_qw + offs_r[None, :]
    wu_ptrs = wg_ptrs + UP * stride_qw
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for c0 in range(0, K8, R):                                   # one chunk of 8R inputs per step
        xv = tl.load(x_ptrs + c0 * 8)
        if DOT_F32:
            xv = xv.to(tl.float32)
        sz = rn * stride_sg + c0 // G8
        acc_g = _chunk_dot(acc_g, xv, wg_ptrs + c0, sz, sc_ptr, zp_ptr, BLOCK_N, R, DOT_F32)
        if GATED:
            acc_u = _chunk_dot(acc_u, xv, wu_ptrs + c0, sz + UP * stride_sg, sc_ptr, zp_ptr, BLOCK_N, R, DOT_F32)
    if PDL:
        gdc_launch_dependents()
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    mask = (offs_m < M)[:, None] & (offs_n < N_OUT)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             _epilogue(acc_g, acc_u, bias, out_ty, HAS_BIAS, GATED, CLAMP16), mask=mask)


class W4MmaConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# 16-row tiles, from scripts/w4_sweep.py on the H200 (benchmarks/NOTES.md runs 23 and 26: 2x faster than 64-column
# tiles; unrolling K made it slower; 8-14% of the read bandwidth, latency-bound). Larger tiles measured 3-4x slower
# than dequantise + cuBLAS at 2048 rows, so prefill does that instead (`kernels.w4_ops`).
DECODE_MMA = W4MmaConfig(16, 32, 4, 4)
MMA_CONFIGS = [W4MmaConfig(*c) for c in [(16, 32, 4, 4), (16, 64, 4, 4), (16, 32, 8, 3), (16, 16, 4, 4),
                                         (16, 16, 2, 2), (16, 16, 1, 2), (64, 128, 4, 3)]]


def w4_mma(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None, gated: bool = False,
           cfg: W4MmaConfig | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] (gated: [..., N/2] = silu(gate) * up) in x's dtype, on tensor cores."""
    check_device(x)
    k, n = w.in_features, w.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match in_features {k}")
    n_out = n // 2 if gated else n
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n_out} outputs")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n_out)
    cfg = cfg or DECODE_MMA
    pdl = use_pdl(x2)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n_out, cfg.block_n),)
    _w4_mma_kernel[grid](
        x2, w.packed, w.scales, w.zeros, bias if bias is not None else out, out, m, n_out, k // 8, x2.stride(0),
        out.stride(0), w.packed.stride(0), w.scales.stride(0), n_out if gated else 0, G8=w.group_size // 8,
        R=w.chunk_int32, HAS_BIAS=bias is not None, GATED=gated,
        DOT_F32=x.dtype == torch.float32 or interpreting(), CLAMP16=x.dtype == torch.float16, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, GROUP_M=8, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=pdl)
    return out.reshape(*x.shape[:-1], n_out)


@triton.jit
def _w4_dequant_kernel(qw_ptr, sc_ptr, zp_ptr, out_ptr, N, K8, stride_qw, stride_sg, stride_o,
                       G8: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    pid_n = tl.program_id(0)
    rn = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    p = tl.arange(0, 8)
    r = tl.arange(0, R)
    for ch in range(tl.program_id(1) * CHUNKS, tl.minimum((tl.program_id(1) + 1) * CHUNKS, K8 // R)):
        c0 = ch * R
        w = tl.load(qw_ptr + rn[:, None] * stride_qw + c0 + r[None, :])                  # [BLOCK_N, R]
        z = tl.load(zp_ptr + rn * stride_sg + c0 // G8).to(tl.float32)
        s = tl.load(sc_ptr + rn * stride_sg + c0 // G8).to(tl.float32)
        codes = (w[:, None, :] >> (4 * p)[None, :, None]) & 15                          # [BLOCK_N, 8, R]
        q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        val = (q - z[:, None, None]) * s[:, None, None]
        k = c0 * 8 + p[None, :, None] * R + r[None, None, :]
        tl.store(out_ptr + rn[:, None, None] * stride_o + k, val.to(out_ptr.dtype.element_ty))


def w4_dequantize(w: W4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [N, K] = (q - z) * s in `dtype` (computed in fp32, rounded once). Reads N*K*(0.5 + 3/G) bytes, writes
    N*K*sizeof(dtype): bandwidth-bound. Grid (cdiv(N, 16), cdiv(chunks, 8)); tail rows rewrite row N-1 (same values)."""
    check_device(w.packed)
    n, k = w.out_features, w.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.packed.device)
    block_n, chunks = 16, 8
    r = w.chunk_int32
    _w4_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k // 8 // r, chunks))](
        w.packed, w.scales, w.zeros, out, n, k // 8, w.packed.stride(0), w.scales.stride(0), out.stride(0),
        G8=w.group_size // 8, R=r, BLOCK_N=block_n, CHUNKS=chunks, num_warps=4)
    return out
