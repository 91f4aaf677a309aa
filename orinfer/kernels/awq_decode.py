"""AWQ INT4 decode kernel for 2..16 activation rows on tensor cores, with exact dequantised weights.

Nibble p of an int32 sits at bits 4p..4p+3. Masking it in place and OR-ing in the exponent of 2^23 gives, as an fp32
bit pattern, exactly 2^23 + q * 16^(p % 4) (nibbles 4..7 use the word shifted right by 16: one shift per int32 shared
by four weights). Subtracting the same construction of the zero point gives (q - z) * 16^(p % 4) exactly, a small
integer times a power of two, so it is exact in bf16/fp16 too (at most 15 * 16^3 = 61440 < 65504). The eight nibbles
are eight separate [BLOCK_K, BLOCK_C] tiles (compile-time masks, one layout, no reshapes), each fed to its own dot:

    part_p = dot(x [16, BLOCK_K], (q - z) * 16^(p % 4) [BLOCK_K, BLOCK_C])      (exact inputs, fp32 accumulate)
    acc_p += part_p * s * 16^-(p % 4)                                           (once per K step and column)

so the scale multiply leaves the per-weight work, and unlike the generic kernel in awq.py (which rounds (q - z) * s
to the activation dtype before its dot) no weight is rounded: the result is the fp32 reference's up to summation
order. Grid (cdiv(N/8, BLOCK_C), SPLIT_K, cdiv(M, BLOCK_M)); BLOCK_K divides the group size, so a K step loads one
scale/zero row; rows beyond M repeat the last row and are not stored. GATED computes gate columns n and up columns
I + n of a packed gate_up weight and writes silu(g) * u; split-K partial sums go to an fp32 workspace reduced by
awq.py's `_awq_splitk_finish_kernel` (fixed order). Output column of nibble p in int32 column c: 8c + AWQ_PACK_ORDER[p].

Measured on the H200 (benchmarks/NOTES.md run 12, cold weights in graph replay, 16 rows): gate_up 118 us vs 120 us
for awq.py's tensor-core kernel, down 53 us vs 63 us; qkv and o 5-10% slower. Still ~11% of the read bandwidth:
at 16 rows the dequantisation and the operand shuffles to shared memory, not HBM, bound both kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from orinfer.kernels.awq import _store_tile
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _as_float(word, P: tl.constexpr):
    """2^23 + nibble * 16^(P % 4) as fp32: `word` is the int32 (P < 4) or the int32 shifted right by 16 (P >= 4)."""
    if P % 4 == 0:
        bits = (word & 0xF) | 0x4B000000
    elif P % 4 == 1:
        bits = (word & 0xF0) | 0x4B000000
    elif P % 4 == 2:
        bits = (word & 0xF00) | 0x4B000000
    else:
        bits = (word & 0xF000) | 0x4B000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scale_of(sc_row_ptr, c_ld, P: tl.constexpr, COL: tl.constexpr):
    """The group's scales for nibble P's columns, times 16^-(P % 4) (exact) so (q - z) * 16^p * s' = (q - z) * s."""
    s = tl.load(sc_row_ptr + c_ld * 8 + COL).to(tl.float32)
    if P % 4 == 1:
        s = s * 0.0625
    elif P % 4 == 2:
        s = s * 0.00390625
    elif P % 4 == 3:
        s = s * 0.000244140625
    return s


@triton.jit
def _mma_nibble(acc, xv, w, w_hi, z, z_hi, sc_row_ptr, c_ld, P: tl.constexpr, COL: tl.constexpr,
                DOT_F32: tl.constexpr):
    if P < 4:
        q = _as_float(w, P) - _as_float(z, P)[None, :]
    else:
        q = _as_float(w_hi, P) - _as_float(z_hi, P)[None, :]
    if DOT_F32:
        part = tl.dot(xv, q, input_precision="ieee")
    else:
        part = tl.dot(xv, q.to(xv.dtype))                       # exact: (q - z) * 16^(p%4) fits 16-bit floats
    return acc + part * _scale_of(sc_row_ptr, c_ld, P, COL)[None, :]


@triton.jit
def _mma_columns(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, xv, qw_ptrs, z, sc_row_ptr, c_ld,
                 DOT_F32: tl.constexpr):
    w = tl.load(qw_ptrs, eviction_policy="evict_first")
    w_hi = w >> 16
    z_hi = z >> 16
    acc0 = _mma_nibble(acc0, xv, w, w_hi, z, z_hi, sc_row_ptr, c_ld, 0, 0, DOT_F32)
    acc1 = _mma_nibble(acc1, xv, w, w_hi, z, z_hi, sc_row_ptr, c_ld, 1, 2, DOT_F32)
    acc2 = _mma_nibble(acc2, xv, w, w_hi, z, z_hi, sc_row_ptr, c_ld, 2, 4, DOT_F32)
    acc3 = _mma_nibble(acc3, xv, w, w_hi, z, z_hi, sc_row_ptr, c_ld, 3, 6, DOT_F32)
    acc4 = _mma_nibble(acc4, xv, w, w_hi, z, z_hi, sc_row_ptr, c_ld, 4, 1, DOT_F32)
    acc5 = _mma_nibble(acc5, xv, w, w_hi, z, z_hi, sc_row_ptr, c_ld, 5, 3, DOT_F32)
    acc6 = _mma_nibble(acc6, xv, w, w_hi, z, z_hi, sc_row_ptr, c_ld, 6, 5, DOT_F32)
    acc7 = _mma_nibble(acc7, xv, w, w_hi, z, z_hi, sc_row_ptr, c_ld, 7, 7, DOT_F32)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _nibble_mma_kernel(x_ptr, qw_ptr, qz_ptr, sc_ptr, b_ptr, out_ptr, part_ptr,
                       M, N_OUT, K, G, K_SPLIT, stride_xm, stride_qw, stride_qz, stride_sc, UP8,
                       HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                       CLAMP16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(2)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)                  # padding rows repeat the last row: no masks
    offs_c = pid_n * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ld = tl.minimum(offs_c, N_OUT // 8 - 1)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :]
    zero = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    g0, g1, g2, g3, g4, g5, g6, g7 = zero, zero, zero, zero, zero, zero, zero, zero
    u0, u1, u2, u3, u4, u5, u6, u7 = zero, zero, zero, zero, zero, zero, zero, zero
    for k0 in range(k_lo, k_hi, BLOCK_K):
        grp = k0 // G
        xv = tl.load(x_ptrs + k0)
        if DOT_F32:
            xv = xv.to(tl.float32)
        qw_ptrs = qw_ptr + (k0 + offs_k)[:, None] * stride_qw + c_ld[None, :]
        z = tl.load(qz_ptr + grp * stride_qz + c_ld)
        sc_row = sc_ptr + grp * stride_sc
        g0, g1, g2, g3, g4, g5, g6, g7 = _mma_columns(g0, g1, g2, g3, g4, g5, g6, g7, xv, qw_ptrs, z, sc_row, c_ld,
                                                      DOT_F32)
        if GATED:
            z = tl.load(qz_ptr + grp * stride_qz + c_ld + UP8)
            u0, u1, u2, u3, u4, u5, u6, u7 = _mma_columns(u0, u1, u2, u3, u4, u5, u6, u7, xv, qw_ptrs + UP8, z,
                                                          sc_row + UP8 * 8, c_ld, DOT_F32)
    if PDL:
        gdc_launch_dependents()
    row = offs_m.to(tl.int64)
    _store_tile(g0, u0, row, offs_c * 8 + 0, out_ptr, part_ptr, b_ptr, pid_k, M, N_OUT, N_OUT, HAS_BIAS, GATED, SPLIT,
                CLAMP16)
    _store_tile(g1, u1, row, offs_c * 8 + 2, out_ptr, part_ptr, b_ptr, pid_k, M, N_OUT, N_OUT, HAS_BIAS, GATED, SPLIT,
                CLAMP16)
    _store_tile(g2, u2, row, offs_c * 8 + 4, out_ptr, part_ptr, b_ptr, pid_k, M, N_OUT, N_OUT, HAS_BIAS, GATED, SPLIT,
                CLAMP16)
    _store_tile(g3, u3, row, offs_c * 8 + 6, out_ptr, part_ptr, b_ptr, pid_k, M, N_OUT, N_OUT, HAS_BIAS, GATED, SPLIT,
                CLAMP16)
    _store_tile(g4, u4, row, offs_c * 8 + 1, out_ptr, part_ptr, b_ptr, pid_k, M, N_OUT, N_OUT, HAS_BIAS, GATED, SPLIT,
                CLAMP16)
    _store_tile(g5, u5, row, offs_c * 8 + 3, out_ptr, part_ptr, b_ptr, pid_k, M, N_OUT, N_OUT, HAS_BIAS, GATED, SPLIT,
                CLAMP16)
    _store_tile(g6, u6, row, offs_c * 8 + 5, out_ptr, part_ptr, b_ptr, pid_k, M, N_OUT, N_OUT, HAS_BIAS, GATED, SPLIT,
                CLAMP16)
    _store_tile(g7, u7, row, offs_c * 8 + 7, out_ptr, part_ptr, b_ptr, pid_k, M, N_OUT, N_OUT, HAS_BIAS, GATED, SPLIT,
                CLAMP16)
