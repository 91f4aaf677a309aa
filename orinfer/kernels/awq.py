"""AWQ INT4 weights (W4A16): dequantisation, decode GEMV and prefill GEMM with the dequantisation fused in.

Format (AutoAWQ "gemm", as in HF AWQ checkpoints). For a linear with K inputs, N outputs and group size G:
  qweight [K, N/8] int32   eight 4-bit weights per int32, in AWQ's interleaved order: nibble p (bits 4p..4p+3) of
                           qweight[k, j] holds output column 8j + AWQ_PACK_ORDER[p], AWQ_PACK_ORDER = 0,2,4,6,1,3,5,7;
                           equivalently column 8j + c sits in nibble AWQ_UNPACK_ORDER[c] = 0,4,1,5,2,6,3,7.
  qzeros  [K/G, N/8] int32 4-bit zero points, packed the same way
  scales  [K/G, N]   fp16  one scale per group and output column
Math: W^T[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]; y [B, N] = x [B, K] W^T (+ b). Products and sums are fp32,
the result is rounded once to x's dtype. fp16 activations: the fp32 result is clamped to +-65504 before the cast
(Qwen3 activations can leave fp16's range; a clamp keeps the next RMSNorm finite instead of producing inf/NaN).

Bytes moved per call: K*N/2 (qweight) + K*N/G * (2 + 1/2) (scales, zeros) + activations. At G = 128 that is
0.52 bytes per weight instead of bf16's 2: the decode roofline is ~3.9x better. Qwen3-8B, batch 1: qkv 12.6 MB,
o 8.4 MB, gate_up 50 MB, down 25 MB per layer.

Kernels (one file: Triton kernels, pure-torch references `*_ref`, wrappers that check, pick a config and launch):
  * `_awq_fma_kernel` (decode, one row): CUDA-core GEMV. Grid (cdiv(N, BLOCK_N), SPLIT_K). A program owns BLOCK_N
    output columns (BLOCK_N/8 int32 per qweight row: coalesced 4-16 byte vectors along N) and a K range; per step it
    loads a [BLOCK_K, BLOCK_N/8] int32 tile, unpacks it in registers to [BLOCK_K, BLOCK_N/8, 8] with shifts and masks,
    turns nibbles into floats without an int->float convert (OR the nibble into the mantissa of 2^23 and subtract
    2^23 + z: exact), multiplies by the group's scale and x[k] and accumulates in fp32; one reduction over K at the
    end. BLOCK_K divides G, so every tile lies in one group (one scale/zero row per tile).
  * `_awq_mm_kernel` (tensor cores, any rows): grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K), grouped
    ordering over M for L2 reuse. Per K step: x tile [BLOCK_M, BLOCK_K]; int32 tile [BLOCK_K, BLOCK_N/8] unpacked to
    [BLOCK_K, BLOCK_N], dequantised in fp32 and rounded to x's 16-bit type, then `tl.dot` (fp32 accumulate). fp32
    x (CPU tests, mixed mode) uses an exact fp32 dot. Decode with 2..16 rows runs it with BLOCK_M = 16.
  * Split-K (decode shapes have too few column tiles to fill a GPU): each program writes fp32 partial sums to a
    workspace [SPLIT_K, M, N] and `_awq_splitk_finish_kernel` adds them in a fixed order (deterministic: no atomics)
    and applies the epilogue (bias, SwiGLU, clamp, cast).
  * GATED (`awq_fused_gate_up_silu`): the packed gate_up weight has gate columns 0..I-1 and up columns I..2I-1; a
    program accumulates gate columns n and up columns I + n together and writes silu(g) * u, with g and u rounded to
    the activation dtype first as the unfused GEMM + `silu_and_mul` does; the [B, 2I] intermediate never exists.
  * `_awq_dequant_kernel`: W^T [K, N] in a 16-bit (or fp32) dtype; large prefills may dequantise into a temporary
    and call cuBLAS (`awq_linear` picks by timing, or by row count when timing is off).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from orinfer.kernels.gemv import _Tuner, check_device, interpreting
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)    # nibble p holds column 8j + AWQ_PACK_ORDER[p]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8j + c is in nibble AWQ_UNPACK_ORDER[c]
MAX_GEMV_ROWS = 16
FP16_MAX = 65504.0
_MAGIC = 0x4B000000       # bits of 2^23 as fp32: (MAGIC | q) as fp32 == 2^23 + q for 0 <= q < 2^23
_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- references ----------------------------------------------------------------------------------------------------

def awq_shapes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
               ) -> tuple[int, int, int]:
    """(K, N, G) of an AWQ linear after checking every shape and dtype; ValueError naming the mismatch."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [in, out/8], got shape {tuple(qweight.shape)}")
    k, n8 = qweight.shape
    g = k if group_size == -1 else int(group_size)
    if g <= 0 or k % g:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    if tuple(qzeros.shape) != (k // g, n8):
        raise ValueError(f"qzeros {tuple(qzeros.shape)} should be {(k // g, n8)} for qweight {tuple(qweight.shape)}")
    if tuple(scales.shape) != (k // g, 8 * n8):
        raise ValueError(f"scales {tuple(scales.shape)} should be {(k // g, 8 * n8)} for qweight "
                         f"{tuple(qweight.shape)}")
    return k, 8 * n8, g


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [R, 8C] int32 values 0..15 in column order (undoes AWQ's nibble interleave)."""
    shifts = torch.tensor([4 * p for p in AWQ_UNPACK_ORDER], dtype=torch.int32, device=packed.device)
    values = (packed.to(torch.int32)[..., None] >> shifts) & 0xF
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def awq_dequantize_ref(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """W^T [K, N] = (q - z) * s in `dtype` (default: the scales' dtype); computed in fp32 (fp64 if asked)."""
    _, _, g = awq_shapes(qweight, qzeros, scales, group_size)
    out_dtype = dtype or scales.dtype
    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    q = awq_unpack(qweight).to(compute)
    z = awq_unpack(qzeros).to(compute).repeat_interleave(g, dim=0)
    s = scales.to(compute).repeat_interleave(g, dim=0)
    return ((q - z) * s).to(out_dtype)


def _clamp_cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float16:
        y = y.clamp(-FP16_MAX, FP16_MAX)
    return y.to(dtype)


def awq_linear_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b): dequantise, multiply in fp32 (fp64 for fp64 x), round once to x's dtype (fp16: clamped)."""
    k, n, _ = awq_shapes(qweight, qzeros, scales, group_size)
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match in_features {k}")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = awq_dequantize_ref(qweight, qzeros, scales, group_size, dtype=compute)
    y = x.reshape(-1, k).to(compute) @ w
    if bias is not None:
        y = y + bias.to(compute)
    return _clamp_cast(y, x.dtype).reshape(*x.shape[:-1], n)


def awq_fused_gate_up_silu_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                               group_size: int) -> torch.Tensor:
    """silu(g) * u for the packed gate_up weight (gate columns first), rounding as GEMM + `silu_and_mul_ref` does
    (g, u and silu(g) rounded to x's dtype; the product of two 16-bit values is exact in fp32, then rounded)."""
    gu = awq_linear_ref(x, qweight, qzeros, scales, group_size)
    inter = gu.shape[-1] // 2
    g, u = gu[..., :inter], gu[..., inter:]
    if x.dtype in (torch.float16, torch.bfloat16):
        return _clamp_cast(F.silu(g).float() * u.float(), x.dtype)
    return F.silu(g) * u


# --- Triton kernels ------------------------------------------------------------------------------------------------

@triton.jit
def _nibbles_as_float(v, shifts):
    """2^23 + ((v >> shifts) & 15) as fp32, without an int->float conversion (shifts broadcast against v)."""
    return (((v >> shifts) & 15) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _round_to(v, out_ty: tl.constexpr, CLAMP16: tl.constexpr):
    if CLAMP16:
        v = tl.minimum(tl.maximum(v, -65504.0), 65504.0)
    return v.to(out_ty)


@triton.jit
def _epilogue(g, u, bias, out_ty: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
              CLAMP16: tl.constexpr):
    """fp32 sums -> stored values: + bias, or SwiGLU with the unfused path's roundings; fp16 clamped."""
    if HAS_BIAS:
        g += bias
    if GATED:
        g = _round_to(g, out_ty, CLAMP16).to(tl.float32)
        u = _round_to(u, out_ty, CLAMP16).to(tl.float32)
        s = _round_to(g / (1.0 + tl.exp(-g)), out_ty, CLAMP16).to(tl.float32)
        g = s * u
    return _round_to(g, out_ty, CLAMP16)


@triton.jit
def _fma_step(acc, xk, w, z, s, shifts):
    """acc [BLOCK_K, BLOCK_C, 8] += x[k] * (q - z) * s for one int32 tile w [BLOCK_K, BLOCK_C] of one group."""
    wf = (_nibbles_as_float(w[:, :, None], shifts[None, None, :])
          - _nibbles_as_float(z[:, None], shifts[None, :])[None, :, :]) * s[None, :, :]
    return acc + xk[:, None, None] * wf


@triton.jit
def _awq_fma_kernel(x_ptr, qw_ptr, qz_ptr, sc_ptr, b_ptr, out_ptr, part_ptr,
                    N_OUT, K, G, K_SPLIT, stride_qw, stride_qz, stride_sc, UP8,
                    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr, CLAMP16: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_c = pid_n * BLOCK_C + tl.arange(0, BLOCK_C)          # packed (int32) columns of this program
    c_ld = tl.minimum(offs_c, N_OUT // 8 - 1)                  # tail columns: computed twice, never stored
    j = tl.arange(0, 8)
    shifts = (j & 1) * 16 + (j >> 1) * 4                       # nibble of column 8c + j: AWQ_UNPACK_ORDER[j]
    cols = c_ld[:, None] * 8 + j[None, :]                      # [BLOCK_C, 8] output columns (clamped)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc_g = tl.zeros([BLOCK_K, BLOCK_C, 8], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_K, BLOCK_C, 8], dtype=tl.float32)
    # UNROLL tiles of BLOCK_K rows per step, all in one group (the wrapper keeps BLOCK_K * UNROLL dividing G): their
    # loads are issued together, so more bytes are in flight per program without a larger accumulator.
    for k0 in range(k_lo, k_hi, BLOCK_K * UNROLL):
        grp = k0 // G
        z = tl.load(qz_ptr + grp * stride_qz + c_ld)
        s = tl.load(sc_ptr + grp * stride_sc + cols).to(tl.float32)
        if GATED:
            z_u = tl.load(qz_ptr + grp * stride_qz + c_ld + UP8)
            s_u = tl.load(sc_ptr + grp * stride_sc + cols + UP8 * 8).to(tl.float32)
        for r in tl.static_range(UNROLL):
            rows = k0 + r * BLOCK_K + offs_k
            xk = tl.load(x_ptr + rows).to(tl.float32)
            w_ptrs = qw_ptr + rows[:, None] * stride_qw + c_ld[None, :]
            acc_g = _fma_step(acc_g, xk, tl.load(w_ptrs, eviction_policy="evict_first"), z, s, shifts)
            if GATED:
                acc_u = _fma_step(acc_u, xk, tl.load(w_ptrs + UP8, eviction_policy="evict_first"), z_u, s_u, shifts)
    if PDL:
        gdc_launch_dependents()
    g = tl.sum(acc_g, axis=0)
    u = tl.sum(acc_u, axis=0)
    out_cols = offs_c[:, None] * 8 + j[None, :]
    mask = (offs_c < N_OUT // 8)[:, None] & (j < 8)[None, :]
    if SPLIT:
        width = 2 * N_OUT if GATED else N_OUT
        base = part_ptr + pid_k * width
        tl.store(base + out_cols, g, mask=mask)
        if GATED:
            tl.store(base + N_OUT + out_cols, u, mask=mask)
    else:
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(b_ptr + out_cols, mask=mask, other=0.0).to(tl.float32)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + out_cols, _epilogue(g, u, bias, out_ty, HAS_BIAS, GATED, CLAMP16), mask=mask)


@triton.jit
def _dequant_tile(w, z, s, shifts_n, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 tile [BLOCK_K, BLOCK_N/8] -> fp32 [BLOCK_K, BLOCK_N] = (q - z) * s, with z (packed int32, loaded per
    column) and s [BLOCK_N] of the tile's group."""
    w2 = tl.reshape(tl.broadcast_to(w[:, :, None], (BLOCK_K, BLOCK_N // 8, 8)), (BLOCK_K, BLOCK_N))
    return (_nibbles_as_float(w2, shifts_n[None, :]) - _nibbles_as_float(z, shifts_n)[None, :]) * s[None, :]


@triton.jit
def _awq_mm_kernel(x_ptr, qw_ptr, qz_ptr, sc_ptr, b_ptr, out_ptr, part_ptr,
                   M, N_OUT, K, G, K_SPLIT, stride_xm, stride_om, stride_qw, stride_qz, stride_sc, UP8,
                   HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                   CLAMP16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    per_group = GROUP_M * num_n                                 # grouped ordering: GROUP_M row tiles share W tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    offs_k = tl.arange(0, BLOCK_K)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)                # clamped rows/columns: loads need no masks
    n_ld = tl.minimum(offs_n, N_OUT - 1)
    c_ld = tl.minimum(offs_c, N_OUT // 8 - 1)
    shifts_n = (offs_n & 1) * 16 + ((offs_n >> 1) & 3) * 4
    z_col = n_ld // 8
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        grp = k0 // G
        xv = tl.load(x_ptrs + k0)
        w_ptrs = qw_ptr + (k0 + offs_k)[:, None] * stride_qw + c_ld[None, :]
        w = tl.load(w_ptrs, eviction_policy="evict_last")
        z = tl.load(qz_ptr + grp * stride_qz + z_col)
        s = tl.load(sc_ptr + grp * stride_sc + n_ld).to(tl.float32)
        wt = _dequant_tile(w, z, s, shifts_n, BLOCK_K, BLOCK_N)
        if DOT_F32:
            xf = xv.to(tl.float32)
            acc_g = tl.dot(xf, wt, acc_g, input_precision="ieee")
        else:
            acc_g = tl.dot(xv, wt.to(xv.dtype), acc_g)
        if GATED:
            w = tl.load(w_ptrs + UP8, eviction_policy="evict_last")
            z = tl.load(qz_ptr + grp * stride_qz + z_col + UP8)
            s = tl.load(sc_ptr + grp * stride_sc + n_ld + UP8 * 8).to(tl.float32)
            wt = _dequant_tile(w, z, s, shifts_n, BLOCK_K, BLOCK_N)
            if DOT_F32:
                acc_u = tl.dot(xf, wt, acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(xv, wt.to(xv.dtype), acc_u)
    if PDL:
        gdc_launch_dependents()
    _store_tile(acc_g, acc_u, offs_m.to(tl.int64), offs_n, out_ptr, part_ptr, b_ptr, pid_k, M, N_OUT, stride_om,
                HAS_BIAS, GATED, SPLIT, CLAMP16)


@triton.jit
def _store_tile(g, u, rows, cols, out_ptr, part_ptr, b_ptr, pid_k, M, N_OUT, stride_om,
                HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr, CLAMP16: tl.constexpr):
    """fp32 sums g (and u) [R, C] of output rows `rows` [R] (int64) and columns `cols` [C]: into the split-K
    workspace [SPLIT_K, M, (2)N] when split, else through the epilogue into out (row stride stride_om)."""
    mask = (rows < M)[:, None] & (cols < N_OUT)[None, :]
    if SPLIT:
        width = 2 * N_OUT if GATED else N_OUT
        base = part_ptr + (pid_k * M + rows)[:, None] * width + cols[None, :]
        tl.store(base, g, mask=mask)
        if GATED:
            tl.store(base + N_OUT, u, mask=mask)
    else:
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=cols < N_OUT, other=0.0).to(tl.float32)[None, :]
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
                 _epilogue(g, u, bias, out_ty, HAS_BIAS, GATED, CLAMP16), mask=mask)


@triton.jit
def _awq_splitk_finish_kernel(part_ptr, b_ptr, out_ptr, M, N_OUT, SPLIT_K, stride_om,
                              HAS_BIAS: tl.constexpr, GATED: tl.constexpr, CLAMP16: tl.constexpr,
                              BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N_OUT
    width = 2 * N_OUT if GATED else N_OUT
    g = tl.zeros([BLOCK], dtype=tl.float32)
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(0, SPLIT_K):                            # fixed order: the result does not depend on timing
        base = part_ptr + (split * M + row) * width
        g += tl.load(base + offs, mask=mask, other=0.0)
        if GATED:
            u += tl.load(base + N_OUT + offs, mask=mask, other=0.0)
    if PDL:
        gdc_launch_dependents()
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_om + offs, _epilogue(g, u, bias, out_ty, HAS_BIAS, GATED, CLAMP16), mask=mask)


@triton.jit
def _awq_dequant_kernel(qw_ptr, qz_ptr, sc_ptr, out_ptr, K, N8, G, stride_qw, stride_qz, stride_sc, stride_o,
                        BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, 8)
    shifts = (j & 1) * 16 + (j >> 1) * 4
    m2 = (offs_k < K)[:, None] & (offs_c < N8)[None, :]
    grp = (offs_k // G)[:, None]
    w = tl.load(qw_ptr + offs_k[:, None] * stride_qw + offs_c[None, :], mask=m2, other=0)
    z = tl.load(qz_ptr + grp * stride_qz + offs_c[None, :], mask=m2, other=0)
    cols = (offs_c[:, None] * 8 + j[None, :])[None, :, :]
    m3 = m2[:, :, None] & (j < 8)[None, None, :]
    s = tl.load(sc_ptr + grp[:, :, None] * stride_sc + cols, mask=m3, other=0.0).to(tl.float32)
    v = (_nibbles_as_float(w[:, :, None], shifts[None, None, :])
         - _nibbles_as_float(z[:, :, None], shifts[None, None, :])) * s
    tl.store(out_ptr + offs_k[:, None, None].to(tl.int64) * stride_o + cols, v.to(out_ptr.dtype.element_ty), mask=m3)


# --- launch configs ------------------------------------------------------------------------------------------------

class AWQConfig(NamedTuple):
    kind: str         # "fma" (one row, CUDA cores), "mma" (tensor-core tiles), "dequant" (dequantise + cuBLAS),
                      # "nmma": awq_decode.py's exact-weight tensor-core kernel for 2..16 rows
    block_m: int
    block_n: int      # output columns per program (a multiple of 64 for "mma", of 8 for "fma"; a power of two)
    block_k: int      # rows per K step; capped to the largest power of two dividing the group size
    split_k: int      # 0: chosen from the SM count so the grid fills the GPU; 1: no split
    num_warps: int
    num_stages: int
    unroll: int = 1   # "fma": K tiles loaded per step (more bytes in flight for the same accumulator)


DEQUANT_MATMUL = AWQConfig("dequant", 0, 0, 0, 1, 0, 0)
# Decode (1..16 rows) uses fixed configs measured on the H200 with cold weights in graph replay (run 12-16,
# scripts/awq_sweep.py): every AWQ weight of Qwen3-8B fits in the 50 MB L2, so timing candidates in place (hot L2)
# would pick configs that lose in a real decode step.
DEFAULT_FMA = AWQConfig("fma", 1, 256, 16, 0, 4, 1, 4)
DEFAULT_DECODE_MMA = AWQConfig("nmma", 16, 256, 64, 0, 4, 3)
# Untimed defaults for larger batches (interpreter, ORINFER_AUTOTUNE=0, graph capture of a shape never seen).
DEFAULT_GEMM = AWQConfig("mma", 64, 128, 64, 1, 4, 3)
DEFAULT_GEMM_LARGE = AWQConfig("mma", 128, 128, 64, 1, 8, 3)
# Rows from which an untimed large GEMM dequantises into a temporary and calls cuBLAS (16-bit activations only).
DEQUANT_MIN_ROWS = int(os.environ.get("ORINFER_AWQ_DEQUANT_ROWS", "1024"))
# Alternatives kept for the sweep script and the GPU tests (each must compute the same thing).
FMA_CONFIGS = [AWQConfig("fma", 1, bn, bk, sk, 4, 1, u) for bn, bk, sk, u in
               [(256, 16, 0, 4), (128, 16, 16, 4), (256, 16, 0, 1), (128, 32, 0, 1)]]
DECODE_MMA_CONFIGS = [AWQConfig(kind, 16, bn, bk, 0, 4, st) for kind, bn, bk, st in
                      [("nmma", 256, 64, 3), ("nmma", 256, 128, 3), ("mma", 64, 64, 3), ("mma", 128, 64, 3)]]
GEMM_CONFIGS = [AWQConfig("mma", bm, bn, bk, 1, w, st) for bm, bn, bk, w, st in
                [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 64, 128, 4, 3),
                 (128, 64, 64, 4, 4), (32, 128, 128, 4, 3)]]
TUNER = _Tuner()


def _pow2_divisor(g: int, cap: int) -> int:
    """The largest power of two that divides g, at most cap."""
    block = 1
    while block < cap and g % (block * 2) == 0:
        block *= 2
    return block


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_plan(k: int, block_k: int, tiles: int, split: int, device: torch.device) -> tuple[int, int]:
    """(number of K splits, rows per split): split 0 asks for enough programs to cover each SM about twice."""
    steps = k // block_k
    if split == 0:
        split = 1
        while tiles * split < 2 * _sm_count(device) and split * 2 <= max(steps // 4, 1):
            split *= 2
    split = max(1, min(split, steps))
    k_split = triton.cdiv(steps, split) * block_k
    return triton.cdiv(k, k_split), k_split


def _fits(cfg: AWQConfig, g: int) -> bool:
    """Whether the fused kernels can run this group size with this config (a K step must stay within a group)."""
    return cfg.kind == "dequant" or _pow2_divisor(g, cfg.block_k) >= 16


def _launch(x2: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g: int,
            bias: torch.Tensor | None, n_out: int, gated: bool, cfg: AWQConfig) -> torch.Tensor:
    """Runs one config on x2 [M, K] (unit last stride); returns a new [M, n_out] in x2's dtype."""
    m, k = x2.shape
    if cfg.kind == "dequant" or not _fits(cfg, g):
        w = awq_dequantize(qweight, qzeros, scales, g, dtype=x2.dtype)
        y = x2 @ w if bias is None else torch.addmm(bias.to(x2.dtype), x2, w)
        if x2.dtype == torch.float16:
            y = y.clamp_(-FP16_MAX, FP16_MAX)  # cuBLAS already rounded inf; keep the same guard
        if gated:
            from orinfer.kernels.activation import silu_and_mul  # lazy: keeps the import graph one-way
            y = silu_and_mul(y)
        return y
    block_k = _pow2_divisor(g, cfg.block_k)
    out = torch.empty(m, n_out, dtype=x2.dtype, device=x2.device)
    up8 = n_out // 8 if gated else 0
    clamp16 = x2.dtype == torch.float16
    pdl = use_pdl(x2)
    if cfg.kind == "fma":
        if m != 1:
            raise ValueError("the FMA kernels compute one row; use an 'mma' config for several rows")
        tiles = triton.cdiv(n_out, cfg.block_n)
    else:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_out, cfg.block_n)
    unroll = 1
    if cfg.kind == "fma":
        while unroll < cfg.unroll and g % (block_k * unroll * 2) == 0:
            unroll *= 2
    split, k_split = _split_plan(k, block_k * unroll, tiles, cfg.split_k, x2.device)
    part = out
    if split > 1:
        part = torch.empty(split, m, (2 if gated else 1) * n_out, dtype=torch.float32, device=x2.device)
    b = bias if bias is not None else out
    common = dict(HAS_BIAS=bias is not None, GATED=gated, SPLIT=split > 1, CLAMP16=clamp16, PDL=pdl,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    if cfg.kind == "fma":
        _awq_fma_kernel[(tiles, split)](
            x2, qweight, qzeros, scales, b, out, part, n_out, k, g, k_split, qweight.stride(0), qzeros.stride(0),
            scales.stride(0), up8, BLOCK_C=cfg.block_n // 8, BLOCK_K=block_k, UNROLL=unroll, **common)
    elif cfg.kind == "nmma":
        from orinfer.kernels.awq_decode import _nibble_mma_kernel
        dot_f32 = x2.dtype == torch.float32 or interpreting()
        _nibble_mma_kernel[(triton.cdiv(n_out, cfg.block_n), split, triton.cdiv(m, cfg.block_m))](
            x2, qweight, qzeros, scales, b, out, part, m, n_out, k, g, k_split, x2.stride(0), qweight.stride(0),
            qzeros.stride(0), scales.stride(0), up8, DOT_F32=dot_f32, BLOCK_M=cfg.block_m,
            BLOCK_C=cfg.block_n // 8, BLOCK_K=block_k, **common)
    else:
        dot_f32 = x2.dtype == torch.float32 or interpreting()
        _awq_mm_kernel[(tiles, split)](
            x2, qweight, qzeros, scales, b, out, part, m, n_out, k, g, k_split, x2.stride(0), out.stride(0),
            qweight.stride(0), qzeros.stride(0), scales.stride(0), up8, DOT_F32=dot_f32, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8, **common)
    if split > 1:
        block = 256
        _awq_splitk_finish_kernel[(m, triton.cdiv(n_out, block))](
            part, b, out, m, n_out, split, out.stride(0), HAS_BIAS=bias is not None, GATED=gated, CLAMP16=clamp16,
            BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


# --- public wrappers -----------------------------------------------------------------------------------------------

def supported(x: torch.Tensor, scales: torch.Tensor) -> bool:
    """Activation/scale dtypes the kernels take (fp32, fp16, bf16 each)."""
    return x.dtype in _FLOAT_TYPES and scales.dtype in _FLOAT_TYPES


def _prepare(x, qweight, qzeros, scales, group_size, bias, gated):
    check_device(x)
    k, n, g = awq_shapes(qweight, qzeros, scales, group_size)
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match in_features {k}")
    if gated and n % 16:
        raise ValueError(f"a packed gate/up weight needs out_features divisible by 16, got {n}")
    n_out = n // 2 if gated else n
    if bias is not None and (tuple(bias.shape) != (n_out,) or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n_out} outputs")
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, k, n_out, g


def _run(x, qweight, qzeros, scales, group_size, bias, gated, cfg):
    x2, k, n_out, g = _prepare(x, qweight, qzeros, scales, group_size, bias, gated)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n_out)
    if cfg is None:
        bucket = m if m <= MAX_GEMV_ROWS else 1 << (m - 1).bit_length()
        key = (min(bucket, 1 << 14), k, n_out, g, gated, bias is not None, x.dtype, scales.dtype, str(x.device))
        sixteen = x.dtype != torch.float32
        if m == 1:
            candidates, default = [], DEFAULT_FMA
        elif m <= MAX_GEMV_ROWS:
            candidates, default = [], DEFAULT_DECODE_MMA
        else:
            candidates = GEMM_CONFIGS + ([DEQUANT_MATMUL] if sixteen else [])
            default = (DEQUANT_MATMUL if sixteen and m >= DEQUANT_MIN_ROWS
                       else DEFAULT_GEMM_LARGE if m >= 256 else DEFAULT_GEMM)
        candidates = [c for c in candidates if _fits(c, g)]
        if m <= MAX_GEMV_ROWS:
            cfg = default if _fits(default, g) else DEQUANT_MATMUL
        elif not candidates:  # no power of two >= 16 divides the group size: dequantise + matmul
            cfg = DEQUANT_MATMUL
        else:
            cfg = TUNER.pick(key, candidates, default, x.device,
                             lambda c: _launch(x2, qweight, qzeros, scales, g, bias, n_out, gated, c))
    return _launch(x2, qweight, qzeros, scales, g, bias, n_out, gated, cfg).reshape(*x.shape[:-1], n_out)


def awq_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               bias: torch.Tensor | None = None, cfg: AWQConfig | None = None) -> torch.Tensor:
    """`awq_linear_ref`'s contract on the GPU: x [..., K] -> [..., N] in x's dtype.

    Dispatch by rows: 1 -> CUDA-core GEMV (`_awq_fma_kernel`, split-K); 2..16 -> tensor-core tiles of 16 rows with
    split-K; more -> the fused GEMM, or dequantise + cuBLAS for large prefills. Per shape (rows bucketed to powers of
    two) the fastest candidate is timed once on CUDA; `cfg` forces one (tests)."""
    if not supported(x, scales):
        return awq_linear_ref(x, qweight, qzeros, scales, group_size, bias)
    return _run(x, qweight, qzeros, scales, group_size, bias, False, cfg)


def awq_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None, cfg: AWQConfig | None = None) -> torch.Tensor:
    """Decode GEMV (at most MAX_GEMV_ROWS rows; more go to `awq_linear`). Bandwidth-bound: the target time is
    (K*N/2 + K*N/G*2.5) bytes / HBM bandwidth."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > MAX_GEMV_ROWS:
        return awq_linear(x, qweight, qzeros, scales, group_size, bias)
    return awq_linear(x, qweight, qzeros, scales, group_size, bias, cfg)


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None, cfg: AWQConfig | None = None) -> torch.Tensor:
    """Prefill GEMM with dequantisation fused into the K loop (tensor cores; compute-bound: 2*M*N*K flops)."""
    return awq_linear(x, qweight, qzeros, scales, group_size, bias, cfg or DEFAULT_GEMM)


def awq_fused_gate_up_silu(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                           group_size: int, cfg: AWQConfig | None = None) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) [..., I] from the packed AWQ gate_up (gate columns 0..I-1, up I..2I-1) in one pass:
    each program reads the gate and the up columns of its output tile, so 2*I*K/2 weight bytes are read once and
    the [B, 2I] intermediate is never written. Beyond MAX_GEMV_ROWS rows: `awq_linear` + `silu_and_mul`."""
    if not supported(x, scales):
        return awq_fused_gate_up_silu_ref(x, qweight, qzeros, scales, group_size)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > MAX_GEMV_ROWS and cfg is None:
        from orinfer.kernels.activation import silu_and_mul
        return silu_and_mul(awq_linear(x, qweight, qzeros, scales, group_size))
    return _run(x, qweight, qzeros, scales, group_size, None, True, cfg)


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Triton dequantisation to a new W^T [K, N] in `dtype`: reads K*N/2 + K*N/G*2.5 bytes, writes K*N*sizeof(dtype).
    Grid (cdiv(K, 32), cdiv(N/8, 32)); any group size (each row looks up its own group)."""
    check_device(qweight)
    k, n, g = awq_shapes(qweight, qzeros, scales, group_size)
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_k, block_c = 32, 32
    _awq_dequant_kernel[(triton.cdiv(k, block_k), triton.cdiv(n // 8, block_c))](
        qweight, qzeros, scales, out, k, n // 8, g, qweight.stride(0), qzeros.stride(0), scales.stride(0),
        out.stride(0), BLOCK_K=block_k, BLOCK_C=block_c, num_warps=4)
    return out
