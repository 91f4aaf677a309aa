"""INT4 matmul on tensor cores over the W4 layout (`kernels.w4`): decode batches of 2..32 rows.

Math: y [M, N] = x [M, K] W^T (+ b), W[n, k] = (q - z) * s per group. Per K step of one chunk (8R inputs, 128 for
G >= 128, always inside one group) a program loads the int32 tile [BLOCK_N, R] and x [BLOCK_M, 8R], unpacks the codes
[BLOCK_N, 8R] in k order (nibble p of int32 r is input p*R + r of the chunk) and multiplies on tensor cores with the
weight as the first operand (swap-AB: the weight tile is the MMA's M side, 64 rows for one warpgroup; the few rows of
x are its N side, 16 at least; 1.3-1.5x faster than x first, run 32):

    part = dot(B + q, x^T) - (B + z) * dot(1, x^T)    [BLOCK_N, BLOCK_M], fp32 accumulate
    acc += part * s[group]                             (per output column, once per chunk)

B + q is the code OR-ed into a 16-bit word whose exponent bits read as B (128 in bf16, 1024 in fp16): exact, with
no convert and no subtract per weight; the zero point and B leave through one product with the chunk's sum of x per
row (itself a dot with a tile of ones). No weight is rounded to 16 bits: up to summation order the result is the fp32 reference's (the cancellation costs
at most ~10 of the fp32 accumulator's 24 bits, far below the 16-bit output's rounding). fp32 x (CPU, mixed mode) takes
exact fp32 codes q - z and an exact fp32 dot instead.

Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT). Split-K: a decode GEMM has only N/BLOCK_N tiles (64 for a 4096-wide
output at BLOCK_N 64), too few programs to keep enough bytes in flight, so program (tile, s) takes chunks
s*C .. (s+1)*C - 1 and stores fp32 partial sums (gate and up separately) in a workspace [SPLIT, 2, M, N_OUT];
`_w4_splitk_reduce_kernel` sums the SPLIT partials in a fixed order (deterministic, no atomics) and applies the
epilogue. Rows beyond M repeat the last row and are not stored; rows beyond N repeat the last row of W. GATED: the
packed gate_up weight [2I, K/8]; a program multiplies the gate rows n and the up rows I + n and stores
silu(g) * u with the unfused path's roundings (`_epilogue`).
Traffic: N*K*(0.5 + 3/G) weight bytes per BLOCK_M rows + M*K*2 + M*N*2, plus SPLIT*M*N*8 of partial sums (mostly in
L2): bandwidth-bound in principle; measured 16-21% of the read bandwidth at 16 rows (benchmarks/NOTES.md run 37),
where the previous one-tile-per-program, x-first kernel reached 8-14%.
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
def _codes_plus_base_16(w, BLOCK_N: tl.constexpr, R: tl.constexpr, MAGIC: tl.constexpr, dtype: tl.constexpr):
    """int32 tile [BLOCK_N, R] -> 16-bit B + q [BLOCK_N, 8R] in the chunk's k order (exact; B = 128 for bf16, 1024
    for fp16): each code is OR-ed into a 16-bit word whose exponent bits read as B (MAGIC = 0x4300 bf16, 0x6400
    fp16). Pairing two codes per 32-bit word through join/permute measured 2x slower (run 29): the register
    shuffles cost more than the integer ops they save."""
    shifts = tl.arange(0, 8) * 4
    codes = ((w[:, None, :] >> shifts[None, :, None]) & 15) | MAGIC              # [BLOCK_N, 8, R]
    return tl.reshape(codes.to(tl.int16).to(dtype, bitcast=True), (BLOCK_N, 8 * R))


@triton.jit
def _chunk_dot(acc, xv, w_ptrs, sz_off, sc_ptr, zp_ptr, BLOCK_N: tl.constexpr, R: tl.constexpr,
               DOT_F32: tl.constexpr, MAGIC: tl.constexpr, BASE: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + s * dot(q - z, x^T) for one chunk. 16-bit x: dot(B + q, x^T) minus (B + z) times the
    chunk's sum of x per row, which a second dot with a tile of ones computes already broadcast in the accumulator's
    layout (the tensor cores are idle at these sizes; a cross-warp tl.sum per chunk measured 4% slower, run 37).
    The gated kernel computes that sum once per half: hoisting it into the loop (shared by both halves) measured no
    faster for gate_up and 4-10% slower for the other projections, and building `_w4_dequant_kernel`'s values with
    this file's `_codes_minus_zero` (one copy of the unpack) made it up to 15% slower (run 46, same-call A/B)."""
    w = tl.load(w_ptrs)
    z = tl.load(zp_ptr + sz_off).to(tl.float32)
    s = tl.load(sc_ptr + sz_off).to(tl.float32)
    if DOT_F32:
        part = tl.dot(_codes_minus_zero(w, z, BLOCK_N, R), tl.trans(xv), input_precision="ieee")
    else:
        wq = _codes_plus_base_16(w, BLOCK_N, R, MAGIC, xv.dtype)
        ones = tl.full([BLOCK_N, 8 * R], 1.0, dtype=tl.float32)
        if INTERPRETED:  # the CPU interpreter's bf16 dot reads raw bits: multiply the same (exact) values in fp32
            xt = tl.trans(xv.to(tl.float32))
            part = tl.dot(wq.to(tl.float32), xt, input_precision="ieee")
            xsum = tl.dot(ones, xt, input_precision="ieee")
        else:
            part = tl.dot(wq, tl.trans(xv))
            xsum = tl.dot(ones.to(xv.dtype), tl.trans(xv))
        part -= (z + BASE)[:, None] * xsum
    return acc + part * s[:, None]


@triton.jit
def _w4_mma_kernel(x_ptr, qw_ptr, sc_ptr, zp_ptr, b_ptr, out_ptr, ws_ptr, M, N_OUT, K8, stride_xm, stride_om,
                   stride_qw, stride_sg, UP, CHUNKS_PER_SPLIT, G8: tl.constexpr, R: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GATED: tl.constexpr, DOT_F32: tl.constexpr, CLAMP16: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
                   MAGIC: tl.constexpr, BASE: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):
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
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)    # transposed: the weight is the dot's first operand
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = 0
    k_hi = K8
    if SPLIT > 1:                                                # this program's share of the chunks
        k_lo = tl.program_id(1) * CHUNKS_PER_SPLIT * R
        k_hi = tl.minimum(k_lo + CHUNKS_PER_SPLIT * R, K8)
    for c0 in range(k_lo, k_hi, R):                              # one chunk of 8R inputs per step
        xv = tl.load(x_ptrs + c0 * 8)
        if DOT_F32:
            xv = xv.to(tl.float32)
        sz = rn * stride_sg + c0 // G8
        acc_g = _chunk_dot(acc_g, xv, wg_ptrs + c0, sz, sc_ptr, zp_ptr, BLOCK_N, R, DOT_F32, MAGIC, BASE, INTERPRETED)
        if GATED:
            acc_u = _chunk_dot(acc_u, xv, wu_ptrs + c0, sz + UP * stride_sg, sc_ptr, zp_ptr, BLOCK_N, R, DOT_F32,
                               MAGIC, BASE, INTERPRETED)
    acc_g = tl.trans(acc_g)
    acc_u = tl.trans(acc_u)
    if PDL:
        gdc_launch_dependents()
    mask = (offs_m < M)[:, None] & (offs_n < N_OUT)[None, :]
    if SPLIT > 1:                                                # raw partial sums; the reduce kernel finishes
        part = ws_ptr + (tl.program_id(1) * 2 * M + offs_m[:, None]) * N_OUT + offs_n[None, :]
        tl.store(part, acc_g, mask=mask)
        if GATED:
            tl.store(part + M * N_OUT, acc_u, mask=mask)
    else:
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn).to(tl.float32)[None, :]
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 _epilogue(acc_g, acc_u, bias, out_ty, HAS_BIAS, GATED, CLAMP16), mask=mask)


@triton.jit
def _w4_splitk_reduce_kernel(ws_ptr, b_ptr, out_ptr, M, N_OUT, stride_om, SPLIT: tl.constexpr,
                             HAS_BIAS: tl.constexpr, GATED: tl.constexpr, CLAMP16: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = epilogue(sum_s ws[s, 0, m, n], sum_s ws[s, 1, m, n]) for one row m and BLOCK columns per program;
    grid (M, cdiv(N_OUT, BLOCK)). Reads SPLIT * (1 + GATED) * 4 bytes and writes 2 bytes per output."""
    if PDL:
        gdc_wait()
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N_OUT
    g = tl.zeros([BLOCK], dtype=tl.float32)
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):                             # fixed order: deterministic sums
        row = ws_ptr + (s * 2 * M + m) * N_OUT + offs
        g += tl.load(row, mask=mask, other=0.0)
        if GATED:
            u += tl.load(row + M * N_OUT, mask=mask, other=0.0)
    if PDL:
        gdc_launch_dependents()
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + m.to(tl.int64) * stride_om + offs, _epilogue(g, u, bias, out_ty, HAS_BIAS, GATED, CLAMP16),
             mask=mask)


class W4MmaConfig(NamedTuple):
    block_m: int         # rows of x per tile (the wgmma's N side: 16 is the smallest)
    block_n: int         # output columns per tile (rows of W: the wgmma's M side)
    num_warps: int
    num_stages: int
    split_k: int = 4     # K split over this many programs per tile (then a reduce kernel); 1: one kernel


# Swept with scripts/w4_sweep.py on the H200 at 8 and 16 rows (benchmarks/NOTES.md runs 33-37): BLOCK_N 64 with one
# warpgroup and split 4 are the fastest or within 2% on all four Qwen3-8B projections.
DECODE_MMA = W4MmaConfig(16, 64, 4, 3)
DECODE_MMA_32 = W4MmaConfig(32, 64, 4, 3)   # 17..32 rows: one 32-row tile reads each weight tile once
MMA_CONFIGS = [W4MmaConfig(*c) for c in [(16, 64, 4, 3, 8), (16, 64, 4, 4, 8), (16, 64, 4, 5, 8), (16, 64, 4, 3, 16),
                                         (16, 64, 4, 3, 4), (16, 64, 4, 2, 8), (16, 64, 8, 3, 8), (16, 128, 8, 3, 8),
                                         (16, 64, 4, 4, 16), (16, 128, 4, 3, 16), (16, 64, 4, 3, 1),
                                         (32, 64, 4, 3), (32, 64, 4, 3, 8), (32, 128, 4, 3)]]


def _split_count(split_k: int, chunks: int) -> tuple[int, int]:
    """(splits, chunks per split) with no empty split."""
    per_split = triton.cdiv(chunks, max(1, min(split_k, chunks)))
    return triton.cdiv(chunks, per_split), per_split


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
    cfg = cfg or (DECODE_MMA if m <= 16 else DECODE_MMA_32)
    pdl = use_pdl(x2)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_out, cfg.block_n)
    split, per_split = _split_count(cfg.split_k, k // 8 // w.chunk_int32)
    ws = torch.empty(split, 2, m, n_out, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (tiles, split)
    bias_arg = bias if bias is not None else out
    _w4_mma_kernel[grid](
        x2, w.packed, w.scales, w.zeros, bias_arg, out, ws, m, n_out, k // 8, x2.stride(0), out.stride(0),
        w.packed.stride(0), w.scales.stride(0), n_out if gated else 0, per_split, G8=w.group_size // 8,
        R=w.chunk_int32, HAS_BIAS=bias is not None, GATED=gated,
        DOT_F32=x.dtype == torch.float32, CLAMP16=x.dtype == torch.float16, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, GROUP_M=8, SPLIT=split, MAGIC=0x6400 if x.dtype == torch.float16 else 0x4300,
        BASE=1024.0 if x.dtype == torch.float16 else 128.0, INTERPRETED=interpreting(), PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=pdl)
    if split > 1:
        block = 1024
        _w4_splitk_reduce_kernel[(m, triton.cdiv(n_out, block))](
            ws, bias_arg, out, m, n_out, out.stride(0), SPLIT=split, HAS_BIAS=bias is not None, GATED=gated,
            CLAMP16=x.dtype == torch.float16, BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl)
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


def w4_dequantize(w: W4Weight, dtype: torch.dtype = torch.bfloat16, block_n: int = 16, chunks: int = 2,
                  num_warps: int = 4) -> torch.Tensor:
    """W [N, K] = (q - z) * s in `dtype` (computed in fp32, rounded once). Reads N*K*(0.5 + 3/G) bytes, writes
    N*K*sizeof(dtype): bandwidth-bound. Grid (cdiv(N, block_n), cdiv(K/8R, chunks)); tail rows rewrite row N-1
    (same values). The default tile is run 45's best (scripts/dequant_sweep.py): 62-73% of the read bandwidth on
    Qwen3-8B's projections, 164 us per layer, which is most of AWQ prefill's gap to bf16 (about 9% at 2048 tokens)."""
    check_device(w.packed)
    n, k = w.out_features, w.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.packed.device)
    r = w.chunk_int32
    _w4_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k // 8 // r, chunks))](
        w.packed, w.scales, w.zeros, out, n, k // 8, w.packed.stride(0), w.scales.stride(0), out.stride(0),
        G8=w.group_size // 8, R=r, BLOCK_N=block_n, CHUNKS=chunks, num_warps=num_warps)
    return out
