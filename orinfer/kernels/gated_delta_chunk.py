"""The gated delta rule (Gated DeltaNet) in Triton: `gated_delta_rule_ref`'s contract (kernels/gated_delta.py holds
the batch layout and the per-token math), chunked for prompts and recurrent for decode rows.

Chunked form (chunks of BT = 64 rows of one sequence, value head h). With G_t the within-chunk cumulative sum of the
log-decays g, gamma_t = exp(G_t), S0 the state before the chunk and u_t what token t writes (S_t = e^{g_t} S_{t-1}
+ k_t u_t^T), unrolling the recurrence gives, over the chunk's rows (K, Q [BT, Dk] normalised, V [BT, Dv]):
  (I + A) U = diag(beta) V - diag(beta gamma) K S0,     A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)  (j < i)
  O   = diag(gamma) Q S0 + P U,                         P[i, j] = (q_i . k_j) exp(G_i - G_j)          (j <= i)
  S_C = gamma_C S0 + (K * exp(G_C - G))^T U             (C: the chunk's last row)
so with T = (I + A)^-1 each chunk costs a few [64 x Dk x Dv] matmuls. Three launches: `_unit_rows_kernel` normalises
q and k once per key head; `_chunk_prepare_kernel` computes P and T, which do not depend on the state, for every chunk
at once; `_chunk_scan_kernel` walks each sequence's chunks in order, carrying the state. Decay factors only ever
appear as exp of a difference G_i - G_j <= 0, never as a ratio gamma_i / gamma_j, so strong decays underflow to 0
instead of dividing by it.

Precision: fp32 state, fp32 sums, and products at the model's precision (`dot_precision`):
  fp32 inputs: a product runs as three tf32 tensor-core dots of hi/lo parts (x = hi + lo, hi rounded to tf32's 10
      mantissa bits), about fp32 (as Triton's tf32x3). The operands the scan and the prepare kernel read (unit q and
      k, T, P) are stored already split, as "tf32 pairs", so that they go from memory into the dots instead of being
      split in registers: with Triton's tf32x3 on register tiles both kernels needed 255 registers and spilled
      (H200, Qwen3.5-35B-A3B's heads, 2048 tokens: 2021 us a layer; with the pairs 934, NOTES run 454).
  16-bit inputs (bf16 / fp16 models): one tf32 dot of the hi parts (each operand rounded to tf32 once; no lo parts
      written or read). The state then carries errors of about tf32's unit roundoff (2^-11) of its values, whose
      effect on the 16-bit outputs stays below their own rounding (the interpreter's emulation of this path: output
      RMS error 0.00413 of the output against 0.00411 with three dots). Twice as fast: Qwen3.5-35B-A3B's heads at 2048
      tokens 721 -> 362 us a layer, Qwen3.5-27B's 830 -> 401 (H200, NOTES run 462). fla-core, which vLLM and SGLang
      run for these models, rounds the state to the 16-bit dtype for its products. ORINFER_GDN_FP32_PRODUCTS=1 keeps
      three dots for 16-bit models too.

T is found in blocks of SUB = 16 rows, in exact fp32 (FMA) products: each diagonal block by the Horner iteration
X <- I - N X, which for N strictly lower and nilpotent within 4-row blocks settles block row r on step r (the
operations of forward substitution, not the unstable power series): 3 steps for the 4-blocks, 3 more to merge them
into the 16-block through (I + N) = (I + N_in)(I + D N_out), D = (I + N_in)^-1; then the blocks below the diagonal
by block forward substitution, T_rc = -T_rr sum_j A_rj T_jc.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device, interpreting

CHUNK = 64  # rows per chunk: the size of the triangular solve
SUB = tl.constexpr(16)  # rows of the solve's blocks (CHUNK = 4 SUB: `_chunk_prepare_kernel` unrolls them)
# Launch shapes, from sm_90 compiles of Qwen3.5's heads (Dk = Dv = 128; kernels/sm90.py) and one H200 timing (run 454):
# the 64-row tiles are one warpgroup's tensor-core M, so 4 warps; 8 warps duplicated the dots and spilled more.
PREPARE_WARPS = 4  # 222 registers, no spills
UNIT_ROWS = 16     # rows a program of `_unit_rows_kernel`: 64 spilled at head dim 128 (q, k and both layouts of k)
SCAN_WARPS = 4
SCAN_BLOCK_V = 32  # state columns a scan program: 16 and 64 compiled to as many spills
SCAN_STAGES = 1    # 2 stages of its operand tiles would need 565 KB of shared memory
# 16-bit models' products in three tf32 dots as fp32 models' (about twice the time; module docstring).
FP32_PRODUCTS = os.environ.get("ORINFER_GDN_FP32_PRODUCTS", "0") == "1"


@triton.jit
def sequence_chunk(qsl_ptr, num_seqs, tile, ROWS: tl.constexpr, AT_LEAST_ONE: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence, chunk within it) of the batch's `tile`-th chunk of ROWS rows, chunks numbered in sequence order;
    sequence >= num_seqs when tile is past the last one. AT_LEAST_ONE gives empty sequences one (empty) chunk. The
    per-sequence chunk counts are summed over all sequences (a [BLOCK_S] cumsum): the launch needs no host-side
    lengths."""
    s = tl.arange(0, BLOCK_S)
    in_batch = s < num_seqs
    lo = tl.load(qsl_ptr + s, mask=in_batch, other=0)
    hi = tl.load(qsl_ptr + s + 1, mask=in_batch, other=0)
    counts = (hi - lo + ROWS - 1) // ROWS
    if AT_LEAST_ONE:
        counts = tl.where(in_batch, tl.maximum(counts, 1), 0)
    ends = tl.cumsum(counts, 0)
    seq = tl.sum((ends <= tile).to(tl.int32), 0)
    chunk = tile - tl.sum(tl.where(s == seq, ends - counts, 0), 0)
    return seq, chunk


@triton.jit
def _unit_vectors(ptr, rows, stride_t, head_off, d, valid, D: tl.constexpr):
    """Rows [n, D] of q or k as fp32, L2-normalised as the reference does (x / sqrt(sum x^2 + 1e-6))."""
    x = tl.load(ptr + rows[:, None] * stride_t + head_off + d[None, :], mask=valid[:, None] & (d < D)[None, :],
                other=0.0).to(tl.float32)
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def log_decay(a, dt_bias, A_log):
    """g = -exp(A_log) * softplus(a + dt_bias) in fp32 (softplus as torch's: linear above 20)."""
    x = a + dt_bias
    soft = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return -tl.exp(A_log) * soft


@triton.jit
def _tf32_split(x):
    """(hi, lo), x = hi + lo exactly: hi is x rounded to tf32's 10 mantissa bits (to nearest, ties away from zero:
    the magnitude's bit 12 added, the low 13 bits cleared), lo the rest (|lo| <= 2^-11 |x|)."""
    hi = ((x.to(tl.int32, bitcast=True) + 4096) & -8192).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _mm_pairs(a_hi, a_lo, b_hi, b_lo, acc, PREC: tl.constexpr):
    """acc + a @ b at about fp32 accuracy for operands given as tf32 pairs (a as stored: no split, and no split
    copies, in registers): three tf32 tensor-core dots, the a_lo @ b_lo term (~2^-22 relative) dropped, as Triton's
    tf32x3 does. PREC "tf32" (16-bit models: the module docstring): one dot of the hi parts, the operands rounded
    to tf32 once. PREC "ieee" (the interpreter): one exact dot of the pairs' sums (hi + lo is exact). acc None: 0."""
    if PREC == "ieee":
        return tl.dot(a_hi + a_lo, b_hi + b_lo, acc, input_precision="ieee")
    if PREC == "tf32":  # the hi parts are tf32 values: the interpreter's exact dot computes what the GPU's does
        return tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
    return tl.dot(a_hi, b_lo, acc, input_precision="tf32")


@triton.jit
def _mm(a_hi, a_lo, b, acc, PREC: tl.constexpr):
    """acc + a @ b for a given as its tf32 pair and b [K, N] fp32 (split here, in registers): `_mm_pairs`."""
    b_hi, b_lo = _tf32_split(b)
    return _mm_pairs(a_hi, a_lo, b_hi, b_lo, acc, PREC)


@triton.jit(do_not_specialize=["tokens"])
def _unit_rows_kernel(q_ptr, k_ptr, kq_ptr, kt_ptr, tokens, scale, stride_qt, stride_qh, stride_kt, stride_kh,
                      HK: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    """BT token rows of one key head: k / |k| and q / |q| * scale as tf32 pairs, for the chunk kernels' dots.

    Grid (cdiv(T, BT), Hk), every row (padding too: nothing reads those). Writes kq [2 (k, q), 2 (hi, lo), T, Hk,
    Dk] and kt [2 (hi, lo), Hk, Dk, T] (k again, tokens contiguous: the scan's k^T @ u takes k^T as its first operand,
    which a tf32 dot wants K-major) fp32: 24 bytes written per q/k element read (12 under PREC "tf32", whose dots
    read no lo parts)."""
    kh = tl.program_id(1)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    valid = rows < tokens
    rows = rows.to(tl.int64)
    d = tl.arange(0, BK)
    mask = valid[:, None] & (d < DK)[None, :]
    k_hi, k_lo = _tf32_split(_unit_vectors(k_ptr, rows, stride_kt, kh * stride_kh, d, valid, DK))
    q_hi, q_lo = _tf32_split(_unit_vectors(q_ptr, rows, stride_qt, kh * stride_qh, d, valid, DK) * scale)
    part = tokens.to(tl.int64) * (HK * DK)
    at = rows[:, None] * (HK * DK) + kh * DK + d[None, :]
    at_t = (kh * DK + d[None, :]).to(tl.int64) * tokens + rows[:, None]
    tl.store(kq_ptr + at, k_hi, mask=mask)
    tl.store(kq_ptr + 2 * part + at, q_hi, mask=mask)
    tl.store(kt_ptr + at_t, k_hi, mask=mask)
    if PREC != "tf32":
        tl.store(kq_ptr + part + at, k_lo, mask=mask)
        tl.store(kq_ptr + 3 * part + at, q_lo, mask=mask)
        tl.store(kt_ptr + part + at_t, k_lo, mask=mask)


@triton.jit
def _pair(ptr, offs, part, mask):
    """The tf32 pair (hi at ptr + offs, lo `part` elements further), zeros where masked."""
    return tl.load(ptr + offs, mask=mask, other=0.0), tl.load(ptr + part + offs, mask=mask, other=0.0)


@triton.jit
def _dot16(x, y):
    """x @ y for [SUB, SUB] fp32 blocks, exact fp32 (FMA: 4096 products)."""
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def _unit_lower_inverse16(A):
    """(I + A)^-1 for A [SUB, SUB] strictly lower (the module docstring): the 4x4 diagonal blocks by Horner (row r
    settles on step r), then merged into the 16-block (3 more steps)."""
    i = tl.arange(0, A.shape[0])
    eye = (i[:, None] == i[None, :]).to(tl.float32)
    in4 = (i[:, None] // 4) == (i[None, :] // 4)
    a4 = tl.where(in4, A, 0.0)
    d = eye
    for _ in tl.static_range(3):
        d = eye - _dot16(a4, d)
    n = _dot16(d, tl.where(in4, 0.0, A))
    x = eye
    for _ in tl.static_range(3):
        x = eye - _dot16(n, x)
    return _dot16(x, d)


@triton.jit
def _store_pair(ptr, part, offs, mask, x, PREC: tl.constexpr):
    """Stores x as its tf32 pair: hi at ptr + offs, lo `part` elements further (not under PREC "tf32": no dot reads
    it)."""
    hi, lo = _tf32_split(x)
    tl.store(ptr + offs, hi, mask=mask)
    if PREC != "tf32":
        tl.store(ptr + part + offs, lo, mask=mask)


@triton.jit
def _block(ptr, rows, col0, valid, HV: tl.constexpr, BT: tl.constexpr):
    """The [SUB, SUB] block at `rows` and columns col0 + [0, SUB) of a [T, Hv, BT] scratch (`ptr` at the head)."""
    return tl.load(ptr + rows[:, None] * (HV * BT) + col0 + tl.arange(0, SUB)[None, :], mask=valid[:, None],
                   other=0.0)


@triton.jit
def _store_block_row(ptr, part, rows, valid, x0, x1, x2, x3, HV: tl.constexpr, BT: tl.constexpr,
                     PREC: tl.constexpr):
    """Stores the four [SUB, SUB] blocks of one block row, as tf32 pairs, into a [T, Hv, BT] scratch (`ptr` at the
    head)."""
    offs = rows[:, None] * (HV * BT) + tl.arange(0, SUB)[None, :]
    _store_pair(ptr, part, offs, valid[:, None], x0, PREC)
    _store_pair(ptr + SUB, part, offs, valid[:, None], x1, PREC)
    _store_pair(ptr + 2 * SUB, part, offs, valid[:, None], x2, PREC)
    _store_pair(ptr + 3 * SUB, part, offs, valid[:, None], x3, PREC)


@triton.jit(do_not_specialize=["num_seqs", "tokens"])
def _chunk_prepare_kernel(kq_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, qsl_ptr, tp_ptr, g_ptr, num_seqs, tokens, group,
                          stride_at, stride_bt, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                          BK: tl.constexpr, BT: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr):
    """One chunk of one sequence, one value head: the gates, G, P and T = (I + A)^-1 of the module docstring.

    Grid (chunk bound, Hv), value heads of one key head side by side (their k rows come from L2). Reads the chunk's
    unit q, k pairs (`_unit_rows_kernel`) and a, b; writes T and P rows [BT, BT] as tf32 pairs into tp [2 (T, P),
    2 (hi, lo), T, Hv, BT] and G into [T, Hv] fp32, rows past the sequence left alone: 1028 bytes written per token
    and value head. P and A come from q k^T and k k^T (64 x Dk x 64, three tf32 dots each, operands straight from
    memory); A goes through T's place in the scratch so that the solve can take it in blocks of SUB = 16 rows: each
    diagonal block's inverse (8 exact fp32 products of 16 x 16 x 16), then block forward substitution T_rc = -T_rr
    sum_j A_rj T_jc (10 more). A 64 x 64 solve in tf32x3 dots held too many tiles in registers (255 and spills)."""
    seq, chunk = sequence_chunk(qsl_ptr, num_seqs, tl.program_id(0), BT, False, BLOCK_S)
    if seq < num_seqs:
        h = tl.program_id(1)
        start = tl.load(qsl_ptr + seq) + chunk * BT
        n = tl.minimum(tl.load(qsl_ptr + seq + 1) - start, BT)
        i = tl.arange(0, BT)
        valid = i < n
        rows = (start + i).to(tl.int64)
        d = tl.arange(0, BK)
        kh = h // group
        part = tokens.to(tl.int64) * (HK * DK)
        tp_part = tokens.to(tl.int64) * (HV * BT)
        a = tl.load(a_ptr + rows * stride_at + h, mask=valid, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows * stride_bt + h, mask=valid, other=0.0).to(tl.float32)
        g = tl.where(valid, log_decay(a, tl.load(dtb_ptr + h).to(tl.float32), tl.load(alog_ptr + h).to(tl.float32)),
                     0.0)
        beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)  # rows past the chunk: k = 0, beta = 0, g = 0
        G = tl.cumsum(g, 0)
        tl.store(g_ptr + rows * HV + h, G, mask=valid)
        causal = i[:, None] >= i[None, :]
        decay = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)  # no exp overflow above
        at = rows[:, None] * (HK * DK) + kh * DK + d[None, :]
        mask = valid[:, None] & (d < DK)[None, :]
        k_hi, k_lo = _pair(kq_ptr, at, part, mask)
        q_hi, q_lo = _pair(kq_ptr + 2 * part, at, part, mask)
        offs = rows[:, None] * (HV * BT) + h * BT + i[None, :]
        _store_pair(tp_ptr + 2 * tp_part, tp_part, offs, valid[:, None],
                    _mm_pairs(q_hi, q_lo, tl.trans(k_hi), tl.trans(k_lo), None, PREC) * decay, PREC)
        kk = _mm_pairs(k_hi, k_lo, tl.trans(k_hi), tl.trans(k_lo), None, PREC)
        tl.store(tp_ptr + offs, tl.where(i[:, None] > i[None, :], kk * decay * beta[:, None], 0.0),
                 mask=valid[:, None])
        tl.debug_barrier()  # A is in T's place: every thread's part of it, before any block is read back
        j = tl.arange(0, SUB)
        r0 = (start + j).to(tl.int64)
        r1 = r0 + SUB
        r2 = r0 + 2 * SUB
        r3 = r0 + 3 * SUB
        v0 = j < n
        v1 = SUB + j < n
        v2 = 2 * SUB + j < n
        v3 = 3 * SUB + j < n
        A_at = tp_ptr + h * BT
        T00 = _unit_lower_inverse16(_block(A_at, r0, 0, v0, HV, BT))
        A10 = _block(A_at, r1, 0, v1, HV, BT)
        T11 = _unit_lower_inverse16(_block(A_at, r1, SUB, v1, HV, BT))
        A20 = _block(A_at, r2, 0, v2, HV, BT)
        A21 = _block(A_at, r2, SUB, v2, HV, BT)
        T22 = _unit_lower_inverse16(_block(A_at, r2, 2 * SUB, v2, HV, BT))
        A30 = _block(A_at, r3, 0, v3, HV, BT)
        A31 = _block(A_at, r3, SUB, v3, HV, BT)
        A32 = _block(A_at, r3, 2 * SUB, v3, HV, BT)
        T33 = _unit_lower_inverse16(_block(A_at, r3, 3 * SUB, v3, HV, BT))
        tl.debug_barrier()  # every block read before T overwrites them
        # T = (I + A)^-1 below the diagonal blocks: block forward substitution.
        T10 = -_dot16(T11, _dot16(A10, T00))
        T21 = -_dot16(T22, _dot16(A21, T11))
        T20 = -_dot16(T22, _dot16(A20, T00) + _dot16(A21, T10))
        T32 = -_dot16(T33, _dot16(A32, T22))
        T31 = -_dot16(T33, _dot16(A31, T11) + _dot16(A32, T21))
        T30 = -_dot16(T33, _dot16(A30, T00) + _dot16(A31, T10) + _dot16(A32, T20))
        zero = tl.zeros([SUB, SUB], dtype=tl.float32)
        T_at = tp_ptr + h * BT
        _store_block_row(T_at, tp_part, r0, v0, T00, zero, zero, zero, HV, BT, PREC)
        _store_block_row(T_at, tp_part, r1, v1, T10, T11, zero, zero, HV, BT, PREC)
        _store_block_row(T_at, tp_part, r2, v2, T20, T21, T22, zero, HV, BT, PREC)
        _store_block_row(T_at, tp_part, r3, v3, T30, T31, T32, T33, HV, BT, PREC)


@triton.jit
def _state_tile(qsl_ptr, slot_ptr, init_ptr, state_ptr, stride_ss, DK: tl.constexpr, DV: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr):
    """For a program of grid (cdiv(Dv, BV), Hv, B): its sequence's rows [begin, end), value head h, the key and value
    column indices, and the first BK rows of its [Dk, BV] slice of the sequence's fp32 state (pointers, mask, values:
    zeros when the sequence has no initial state)."""
    seq = tl.program_id(2)
    h = tl.program_id(1)
    begin = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    d = tl.arange(0, BK)
    dv = tl.program_id(0) * BV + tl.arange(0, BV)
    v_mask = dv < DV
    state = (state_ptr + tl.load(slot_ptr + seq).to(tl.int64) * stride_ss + h * (DK * DV)
             + d[:, None] * DV + dv[None, :])
    s_mask = (d < DK)[:, None] & v_mask[None, :]
    S = tl.load(state, mask=s_mask & (tl.load(init_ptr + seq) != 0), other=0.0)
    return begin, end, h, d, dv, v_mask, state, s_mask, S


@triton.jit
def _rows_pair(ptr, part, rows, col0, valid, HK: tl.constexpr, DK: tl.constexpr, HALF: tl.constexpr):
    """The tf32 pair of k or q (`ptr` at its hi part) at `rows` [BT] and head-dim columns col0 + [0, HALF):
    [BT, HALF] tiles, zeros outside the rows and the head."""
    c = col0 + tl.arange(0, HALF)
    return _pair(ptr, rows[:, None] * (HK * DK) + c[None, :], part, valid[:, None] & (c < DK)[None, :])


@triton.jit(do_not_specialize=["tokens"])
def _chunk_scan_kernel(kq_ptr, kt_ptr, v_ptr, b_ptr, qsl_ptr, slot_ptr, init_ptr, tp_ptr, g_ptr, state_ptr, o_ptr,
                       tokens, group, stride_vt, stride_vh, stride_bt, stride_ot, stride_oh, stride_ss,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    """One sequence, value head, BV columns of the state: the chunks in order, the state in registers.

    Grid (cdiv(Dv, BV), Hv, B): the column blocks of a head next to each other, as they read the same q, k, T and
    P. Per chunk: U = T (beta V - beta gamma K S), O = gamma Q S + P U, S <- gamma_C S + K^T (exp(G_C - G) U): five
    products with N = BV, three of them on the state's dependency chain, each three tf32 dots whose first operand
    (k, q, k^T, T, P: the tf32 pairs the other kernels wrote) is loaded as it is. A head dim of 128 is handled in
    two halves of 64 (two [64, BV] state tiles, [64, 64] operand tiles): whole [64, 128] pairs of fp32 tiles did
    not fit in registers. Reads the state tile once and writes it once ([Dk, BV] fp32); per token, v's and o's BV
    columns and, again in each column block, the pairs (k twice, q: 24 Dk bytes; T, P: 1 KiB per value head,
    mostly from L2)."""
    HALF: tl.constexpr = BK // 2 if BK >= 128 else BK
    begin, end, h, dh, dv, v_mask, state, m0, S0 = _state_tile(qsl_ptr, slot_ptr, init_ptr, state_ptr, stride_ss,
                                                                DK, DV, HALF, BV)
    m1 = ((HALF + dh) < DK)[:, None] & v_mask[None, :]
    S1 = tl.load(state + HALF * DV, mask=m1 & (tl.load(init_ptr + tl.program_id(2)) != 0),  # all masked unless the
                 other=0.0)                                                                 # head dim is split
    kh = h // group
    i = tl.arange(0, BT)
    part = tokens.to(tl.int64) * (HK * DK)
    tp_part = tokens.to(tl.int64) * (HV * BT)
    kq_k = kq_ptr + kh * DK
    kq_q = kq_ptr + 2 * part + kh * DK
    for start in range(begin, end, BT):
        n = tl.minimum(end - start, BT)
        valid = i < n
        rows = (start + i).to(tl.int64)
        offs = rows[:, None] * (HV * BT) + h * BT + i[None, :]
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=valid[:, None] & v_mask[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows * stride_bt + h, mask=valid, other=0.0).to(tl.float32)
        beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)
        G = tl.load(g_ptr + rows * HV + h, mask=valid, other=0.0)
        G_last = tl.sum(tl.where(i == n - 1, G, 0.0), 0)
        gamma = tl.exp(G)
        zeros = tl.zeros([BT, BV], dtype=tl.float32)
        # Each pair is loaded where its product needs it, so that its registers and shared memory are reused.
        k_hi, k_lo = _rows_pair(kq_k, part, rows, 0, valid, HK, DK, HALF)
        ks = _mm(k_hi, k_lo, S0, zeros, PREC)
        if HALF < BK:
            k_hi, k_lo = _rows_pair(kq_k, part, rows, HALF, valid, HK, DK, HALF)
            ks = _mm(k_hi, k_lo, S1, ks, PREC)
        x = beta[:, None] * (v - gamma[:, None] * ks)
        T_hi, T_lo = _pair(tp_ptr, offs, tp_part, valid[:, None])
        u = _mm(T_hi, T_lo, x, zeros, PREC)
        q_hi, q_lo = _rows_pair(kq_q, part, rows, 0, valid, HK, DK, HALF)
        qs = _mm(q_hi, q_lo, S0, zeros, PREC)
        if HALF < BK:
            q_hi, q_lo = _rows_pair(kq_q, part, rows, HALF, valid, HK, DK, HALF)
            qs = _mm(q_hi, q_lo, S1, qs, PREC)
        P_hi, P_lo = _pair(tp_ptr + 2 * tp_part, offs, tp_part, valid[:, None])
        o = _mm(P_hi, P_lo, u, gamma[:, None] * qs, PREC)
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=valid[:, None] & v_mask[None, :])
        u_late = u * tl.exp(G_last - G)[:, None]  # rows past the chunk: u = 0
        decay_c = tl.exp(G_last)
        kt = kt_ptr + (kh * DK + dh[:, None]).to(tl.int64) * tokens + rows[None, :]
        kt_hi, kt_lo = _pair(kt, 0, part, (dh < DK)[:, None] & valid[None, :])
        S0 = _mm(kt_hi, kt_lo, u_late, S0 * decay_c, PREC)
        if HALF < BK:
            kt_hi, kt_lo = _pair(kt + HALF * tokens, 0, part, ((HALF + dh) < DK)[:, None] & valid[None, :])
            S1 = _mm(kt_hi, kt_lo, u_late, S1 * decay_c, PREC)
    tl.store(state, S0, mask=m0)
    if HALF < BK:
        tl.store(state + HALF * DV, S1, mask=m1)


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, qsl_ptr, slot_ptr, init_ptr, state_ptr,
                      o_ptr, group, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_at, stride_bt, stride_ot, stride_oh, stride_ss,
                      DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The reference's token loop for one sequence, value head and BV state columns: for decode rows (one token per
    sequence) the state tile [Dk, BV] fp32 is read once, updated and written once, and o written.

    Grid (cdiv(Dv, BV), Hv, B). Per token: S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T q, two reductions over
    Dk (the state's rows; Dv is what programs split). Traffic per decode row and value head: 2 * Dk * Dv * 4 bytes
    of state (128 KiB at 128 x 128: the whole cost) + the q, k, v, o rows."""
    begin, end, h, d, dv, v_mask, state, s_mask, S = _state_tile(qsl_ptr, slot_ptr, init_ptr, state_ptr, stride_ss,
                                                                  DK, DV, BK, BV)
    A_log = tl.load(alog_ptr + h).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    kh = h // group
    d_mask = d < DK
    for t in range(0, end - begin):
        row = begin.to(tl.int64) + t
        k = tl.load(k_ptr + row * stride_kt + kh * stride_kh + d, mask=d_mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row * stride_qt + kh * stride_qh + d, mask=d_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * stride_vt + h * stride_vh + dv, mask=v_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * stride_at + h).to(tl.float32)
        b = tl.load(b_ptr + row * stride_bt + h).to(tl.float32)
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
        S = S * tl.exp(log_decay(a, dt_bias, A_log))
        delta = (v - tl.sum(S * k[:, None], 0)) / (1.0 + tl.exp(-b))
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(o_ptr + row * stride_ot + h * stride_oh + dv, o.to(o_ptr.dtype.element_ty), mask=v_mask)
    tl.store(state, S, mask=s_mask)


# The token loop's cost grows with a sequence's rows, the chunked kernels' is nearly fixed for short inputs (two
# launches over 64-row chunks). Graph-timed on an H200 at Qwen3.5-27B's heads (run 301), loop / chunked: one sequence
# of 1, 4, 16, 64 rows 4 / 153, 9 / 153, 28 / 153, 105 / 157 us; eight sequences of 4, 32, 64 rows 30 / 691,
# 181 / 707, 387 / 730 us. So the loop takes sequences of up to 64 rows (a speculative verify step's k + 1 rows,
# and a CUDA graph bucket of up to 64 rows, whatever mix of sequences it holds).
RECURRENT_MAX_ROWS = 64


def recurrent_fits(tokens: int, num_seqs: int, max_rows_per_seq: int | None) -> bool:
    """Whether the token-loop kernel is the right one: every sequence has at most RECURRENT_MAX_ROWS rows
    (`max_rows_per_seq`, when known), or, unknown, there are no more rows than sequences."""
    if max_rows_per_seq is not None:
        return max_rows_per_seq <= RECURRENT_MAX_ROWS
    return tokens <= num_seqs


def dot_precision(dtype: torch.dtype) -> str:
    """The chunk kernels' products for inputs of `dtype` (module docstring): "ieee" in the interpreter (exact);
    on the GPU "tf32x3" (three tf32 dots, about fp32) for fp32 inputs or under FP32_PRODUCTS, else "tf32"."""
    if interpreting():
        return "ieee"
    return "tf32x3" if dtype == torch.float32 or FP32_PRODUCTS else "tf32"


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, query_start_loc: torch.Tensor,
                     ssm_states: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor, *,
                     decode: bool | None = None, max_rows_per_seq: int | None = None) -> torch.Tensor:
    """`gated_delta_rule_ref`'s contract: q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv] (unit last stride; token
    and head strides free, e.g. views of the conv output), A_log, dt_bias [Hv]; ssm_states [slots, Hv, Dk, Dv] fp32
    contiguous, state_slots [B] int, has_initial_state [B] bool, query_start_loc [B+1] int32 -> o [T, Hv, Dv] in
    v's dtype. Rows past query_start_loc[B] (padding) are left unwritten; empty sequences are allowed.

    decode=True: `_recurrent_kernel` (one launch, a token loop per sequence: right for one row per sequence, correct
    for any). decode=False: the chunked kernels (three launches and fp32 scratch of (6 Hk Dk + 4 Hv 64 + Hv) floats a
    token: 80 KiB at Qwen3.5-35B-A3B's heads, 96 KiB at Qwen3.5-27B's). None picks by `recurrent_fits` from
    `max_rows_per_seq` when the caller knows it (a speculative verify step's few rows a sequence take the token loop),
    else from the shapes alone, T <= B (decode rows, maybe padded), so the call needs no host sync and may be captured
    in a CUDA graph; grids depend on T, B and the head shapes only.

    Dots: exact fp32 in the interpreter; on the GPU three tf32 tensor-core passes for fp32 inputs (about fp32's
    accuracy), one for 16-bit inputs (operands rounded to tf32 once: the module docstring's "Precision").
    """
    check_device(v)
    tokens, k_heads, dk = k.shape
    v_heads, dv = v.shape[1], v.shape[2]
    num_seqs = state_slots.shape[0]
    if (q.shape != k.shape or v.shape[0] != tokens or v_heads % k_heads or a.shape != (tokens, v_heads)
            or b.shape != a.shape or A_log.shape != (v_heads,) or dt_bias.shape != (v_heads,)):
        raise ValueError(f"gated_delta_rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, a "
                         f"{tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, dt_bias "
                         f"{tuple(dt_bias.shape)} do not match")
    if (ssm_states.dtype != torch.float32 or not ssm_states.is_contiguous()
            or tuple(ssm_states.shape[1:]) != (v_heads, dk, dv) or query_start_loc.shape != (num_seqs + 1,)
            or has_initial_state.shape != (num_seqs,)):
        raise ValueError(f"gated_delta_rule: ssm_states {tuple(ssm_states.shape)} {ssm_states.dtype} (contiguous "
                         f"fp32 [slots, {v_heads}, {dk}, {dv}]), query_start_loc {tuple(query_start_loc.shape)}, "
                         f"has_initial_state {tuple(has_initial_state.shape)} for {num_seqs} sequences")
    q, k, v, a, b = (_unit_last(t) for t in (q, k, v, a, b))
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    out = torch.empty(tokens, v_heads, dv, dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return out
    group, scale = v_heads // k_heads, dk ** -0.5
    block_k = max(16, triton.next_power_of_2(dk))
    common = (group, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    if decode is None:
        decode = recurrent_fits(tokens, num_seqs, max_rows_per_seq)
    if decode:
        block_v = min(16, triton.next_power_of_2(dv))  # [Dk, 16] tiles: many programs for a memory-bound kernel
        _recurrent_kernel[(triton.cdiv(dv, block_v), v_heads, num_seqs)](
            q, k, v, a, b, A_log, dt_bias, query_start_loc, state_slots, has_initial_state, ssm_states, out,
            *common, v.stride(0), v.stride(1), a.stride(0), b.stride(0), out.stride(0), out.stride(1),
            ssm_states.stride(0), DK=dk, DV=dv, BK=block_k, BV=block_v, num_warps=2 if block_k <= 128 else 4)
        return out
    prec = dot_precision(v.dtype)
    # Scratch (fp32): unit k and q as tf32 pairs [2, 2, T, Hk, Dk], k's pair again tokens-contiguous [2, Hk, Dk, T],
    # T and P rows as pairs [2, 2, T, Hv, 64] and G [T, Hv]: 80 KiB a token at Qwen3.5-35B-A3B's heads.
    kq = torch.empty(2, 2, tokens, k_heads, dk, dtype=torch.float32, device=v.device)
    kt = torch.empty(2, k_heads, dk, tokens, dtype=torch.float32, device=v.device)
    tp = torch.empty(2, 2, tokens, v_heads, CHUNK, dtype=torch.float32, device=v.device)
    cum = torch.empty(tokens, v_heads, dtype=torch.float32, device=v.device)
    if tokens:
        _unit_rows_kernel[(triton.cdiv(tokens, UNIT_ROWS), k_heads)](
            q, k, kq, kt, tokens, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), HK=k_heads, DK=dk,
            BK=block_k, BT=UNIT_ROWS, PREC=prec, num_warps=4)
        # Sequence b has cdiv(n_b, 64) chunks: at most T // 64 + B over the batch, and at most T.
        _chunk_prepare_kernel[(min(tokens, tokens // CHUNK + num_seqs), v_heads)](
            kq, a, b, A_log, dt_bias, query_start_loc, tp, cum, num_seqs, tokens, group, a.stride(0), b.stride(0),
            HK=k_heads, HV=v_heads, DK=dk, BK=block_k, BT=CHUNK, BLOCK_S=triton.next_power_of_2(num_seqs),
            PREC=prec, num_warps=PREPARE_WARPS)
    block_v = max(16, min(16 if interpreting() else SCAN_BLOCK_V, triton.next_power_of_2(dv)))
    _chunk_scan_kernel[(triton.cdiv(dv, block_v), v_heads, num_seqs)](
        kq, kt, v, b, query_start_loc, state_slots, has_initial_state, tp, cum, ssm_states, out, tokens, group,
        v.stride(0), v.stride(1), b.stride(0), out.stride(0), out.stride(1), ssm_states.stride(0),
        HK=k_heads, HV=v_heads, DK=dk, DV=dv, BK=block_k, BV=block_v, BT=CHUNK, PREC=prec, num_warps=SCAN_WARPS,
        num_stages=SCAN_STAGES)
    return out
