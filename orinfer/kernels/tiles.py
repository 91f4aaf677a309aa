"""Triton helpers shared by the quantized matmul kernels (W4, FP8): the grouped order of output tiles and the epilogue
that turns fp32 sums into stored values (bias, fused SwiGLU with the unfused path's roundings, fp16 clamp)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(v, out_ty: tl.constexpr, CLAMP16: tl.constexpr):
    """v rounded to out_ty; fp16 clamped to +-65504 first (Qwen's activations can overflow fp16)."""
    if CLAMP16:
        v = tl.minimum(tl.maximum(v, -65504.0), 65504.0)
    return v.to(out_ty)


@triton.jit
def epilogue(g, u, bias, out_ty: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, CLAMP16: tl.constexpr):
    """fp32 sums -> stored values: + bias, or SwiGLU with the unfused path's roundings (g, u and silu(g) rounded to
    the activation dtype, as GEMM + `silu_and_mul` do); fp16 clamped to +-65504."""
    if HAS_BIAS:
        g += bias
    if GATED:
        g = round_to(g, out_ty, CLAMP16).to(tl.float32)
        u = round_to(u, out_ty, CLAMP16).to(tl.float32)
        s = round_to(g / (1.0 + tl.exp(-g)), out_ty, CLAMP16).to(tl.float32)
        g = s * u
    return round_to(g, out_ty, CLAMP16)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of program `pid`: programs walk bands of GROUP_M tile rows column by column, so that
    programs running together share the same column's tiles of the second operand in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    band = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // band) * GROUP_M
    band_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % band) % band_m, (pid % band) // band_m


@triton.jit
def tile_rows(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(offs_m, offs_n, rm, rn) of tile (pid_m, pid_n): its row and column indices, and the same clamped to M - 1 /
    N - 1 (rows past the end re-read the last one, so loads need no masks; they are not stored)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, tl.minimum(offs_m, M - 1), tl.minimum(offs_n, N - 1)


@triton.jit
def store_tile(out_ptr, g, u, b_ptr, rn, offs_m, offs_n, mask, stride_om, HAS_BIAS: tl.constexpr,
               GATED: tl.constexpr, CLAMP16: tl.constexpr):
    """Stores `epilogue(g, u, bias[rn])` of a [BLOCK_M, BLOCK_N] tile at out[offs_m, offs_n] (where `mask`)."""
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             epilogue(g, u, bias, out_ty, HAS_BIAS, GATED, CLAMP16), mask=mask)
