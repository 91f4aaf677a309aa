"""The gated delta rule (Gated DeltaNet) in Triton: `gated_delta_rule_ref`'s contract (kernels/gated_delta.py holds
the batch layout and the per-token math), chunked for prompts and recurrent for decode rows.

Chunked form (chunks of BT = 64 rows of one sequence, value head h). With G_t the within-chunk cumulative sum of the
log-decays g, gamma_t = exp(G_t), S0 the state before the chunk and u_t what token t writes (S_t = e^{g_t} S_{t-1}
+ k_t u_t^T), unrolling the recurrence gives, over the chunk's rows (K, Q [BT, Dk] normalised, V [BT, Dv]):
  (I + A) U = diag(beta) V - diag(beta gamma) K S0,     A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j)  (j < i)
  O   = diag(gamma) Q S0 + P U,                         P[i, j] = (q_i . k_j) exp(G_i - G_j)          (j <= i)
  S_C = gamma_C S0 + (K * exp(G_C - G))^T U             (C: the chunk's last row)
so with T = (I + A)^-1 each chunk costs a few [64 x Dk x Dv] matmuls. A, P and T do not depend on the state:
`_chunk_prepare_kernel` computes them for every chunk at once; `_chunk_scan_kernel` then walks each sequence's
chunks in order, carrying the state. Decay factors only ever appear as exp of a difference G_i - G_j <= 0, never as
a ratio gamma_i / gamma_j, so strong decays underflow to 0 instead of dividing by it.

T is found by block forward substitution, in matmuls: for a strictly lower A nilpotent within blocks, the Horner
iteration X <- I - A X (from X = I) settles block row r on step r from rows already settled, the operations of
forward substitution (not the unstable power series), so 3 steps invert the 4x4 diagonal blocks; (I + A) =
(I + A_in)(I + D A_out) with D = (I + A_in)^-1 merges 4-blocks into 16-blocks and those into the 64-block (3 steps
each): 13 dots of 64x64x64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device, interpreting

CHUNK = 64  # rows per chunk: the size of the triangular solve


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
def _settle(N, eye, PREC: tl.constexpr):
    """(I + N)^-1 for N strictly lower with 4 blocks along the diagonal (N zero within them): Horner, 3 steps."""
    x = eye
    for _ in tl.static_range(3):
        x = eye - tl.dot(N, x, input_precision=PREC)
    return x


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for A [BT, BT] strictly lower (BT = 64): diagonal 4-blocks, merged into 16-blocks, then 64."""
    i = tl.arange(0, BT)
    eye = (i[:, None] == i[None, :]).to(tl.float32)
    in4 = (i[:, None] // 4) == (i[None, :] // 4)
    in16 = (i[:, None] // 16) == (i[None, :] // 16)
    d = _settle(tl.where(in4, A, 0.0), eye, PREC)       # within a 4-block, row r settles on step r
    n = tl.dot(d, tl.where(in16 & ~in4, A, 0.0), input_precision=PREC)
    d = tl.dot(_settle(n, eye, PREC), d, input_precision=PREC)
    n = tl.dot(d, tl.where(in16, 0.0, A), input_precision=PREC)
    return tl.dot(_settle(n, eye, PREC), d, input_precision=PREC)


@triton.jit(do_not_specialize=["num_seqs"])
def _chunk_prepare_kernel(q_ptr, k_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, qsl_ptr, tm_ptr, p_ptr, g_ptr, num_seqs,
                          group, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_at, stride_bt,
                          HV: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                          BLOCK_S: tl.constexpr, PREC: tl.constexpr):
    """One chunk of one sequence, one value head: the gates, G, P and T = (I + A)^-1 of the module docstring.

    Grid (chunk bound, Hv), value heads of one key head side by side (their k rows come from L2). Reads the
    chunk's q, k [BT, Dk] and a, b; writes T and P rows [BT, BT] fp32 and G (fp32) into per-token scratch
    [T, Hv, BT] / [T, Hv], rows past the sequence left alone: 2 * Dk input elements read and 516 bytes written per
    token and value head. Work: 2 dots of 64 x 64 x Dk, 13 of 64 x 64 x 64."""
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
        k = _unit_vectors(k_ptr, rows, stride_kt, kh * stride_kh, d, valid, DK)
        q = _unit_vectors(q_ptr, rows, stride_qt, kh * stride_qh, d, valid, DK) * scale
        a = tl.load(a_ptr + rows * stride_at + h, mask=valid, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows * stride_bt + h, mask=valid, other=0.0).to(tl.float32)
        g = tl.where(valid, log_decay(a, tl.load(dtb_ptr + h).to(tl.float32), tl.load(alog_ptr + h).to(tl.float32)),
                     0.0)
        beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)  # rows past the chunk: k = 0, beta = 0, g = 0
        G = tl.cumsum(g, 0)
        causal = i[:, None] >= i[None, :]
        decay = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)  # no exp overflow above
        kk = tl.dot(k, tl.trans(k), input_precision=PREC)
        A = tl.where(i[:, None] > i[None, :], kk * decay * beta[:, None], 0.0)
        P = tl.dot(q, tl.trans(k), input_precision=PREC) * decay
        T = _unit_lower_inverse(A, BT, PREC)
        offs = rows[:, None] * (HV * BT) + h * BT + i[None, :]
        tl.store(tm_ptr + offs, T, mask=valid[:, None])
        tl.store(p_ptr + offs, P, mask=valid[:, None])
        tl.store(g_ptr + rows * HV + h, G, mask=valid)


@triton.jit
def _state_tile(qsl_ptr, slot_ptr, init_ptr, state_ptr, stride_ss, DK: tl.constexpr, DV: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr):
    """For a program of grid (cdiv(Dv, BV), Hv, B): its sequence's rows [begin, end), value head h, the key and value
    column indices, and its [Dk, BV] slice of the sequence's fp32 state (pointers, mask, values: zeros when the
    sequence has no initial state)."""
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
def _chunk_scan_kernel(q_ptr, k_ptr, v_ptr, b_ptr, qsl_ptr, slot_ptr, init_ptr, tm_ptr, p_ptr, g_ptr, state_ptr,
                       o_ptr, group, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
                       stride_ot, stride_oh, stride_ss,
                       HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       BT: tl.constexpr, PREC: tl.constexpr):
    """One sequence, value head, BV columns of the state: the chunks in order, the state in registers.

    Grid (cdiv(Dv, BV), Hv, B): the column blocks of a head next to each other, as they read the same q, k, T and
    P. Per chunk: U = T (beta V - beta gamma K S), O = gamma Q S + P U, S <- gamma_C S + (K exp(G_C - G))^T U: five
    dots with N = BV, three of them on the state's dependency chain. Reads the state tile once and writes it once
    ([Dk, BV] fp32); per token, v's and o's BV columns and, again in each column block, q and k (normalised again
    here: cheaper than storing them in fp32), b, and the T, P rows (512 bytes, mostly from L2)."""
    begin, end, h, d, dv, v_mask, state, s_mask, S = _state_tile(qsl_ptr, slot_ptr, init_ptr, state_ptr, stride_ss,
                                                                  DK, DV, BK, BV)
    kh = h // group
    i = tl.arange(0, BT)
    for start in range(begin, end, BT):
        n = tl.minimum(end - start, BT)
        valid = i < n
        rows = (start + i).to(tl.int64)
        k = _unit_vectors(k_ptr, rows, stride_kt, kh * stride_kh, d, valid, DK)
        q = _unit_vectors(q_ptr, rows, stride_qt, kh * stride_qh, d, valid, DK) * scale
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=valid[:, None] & v_mask[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows * stride_bt + h, mask=valid, other=0.0).to(tl.float32)
        beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)
        G = tl.load(g_ptr + rows * HV + h, mask=valid, other=0.0)
        G_last = tl.sum(tl.where(i == n - 1, G, 0.0), 0)
        gamma = tl.exp(G)
        offs = rows[:, None] * (HV * BT) + h * BT + i[None, :]
        T = tl.load(tm_ptr + offs, mask=valid[:, None], other=0.0)
        P = tl.load(p_ptr + offs, mask=valid[:, None], other=0.0)
        x = beta[:, None] * (v - gamma[:, None] * tl.dot(k, S, input_precision=PREC))
        u = tl.dot(T, x, input_precision=PREC)
        o = tl.dot(q * gamma[:, None], S, input_precision=PREC) + tl.dot(P, u, input_precision=PREC)
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=valid[:, None] & v_mask[None, :])
        k_late = k * tl.exp(G_last - G)[:, None]  # rows past the chunk: k = 0
        S = S * tl.exp(G_last) + tl.dot(tl.trans(k_late), u, input_precision=PREC)
    tl.store(state, S, mask=s_mask)


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
    for any). decode=False: the chunked kernels (two launches and fp32 scratch of 2 * T * Hv * 64 + T * Hv floats,
    24 MiB per 1024 tokens at Hv = 48). None picks by `recurrent_fits` from `max_rows_per_seq` when the caller knows
    it (a speculative verify step's few rows a sequence take the token loop), else from the shapes alone, T <= B
    (decode rows, maybe padded), so
    the call needs no host sync and may be captured in a CUDA graph; grids depend on T, B and the head shapes only.

    Dots: exact fp32 in the interpreter, tf32x3 on the GPU (three tensor-core passes, about fp32's accuracy; tf32
    alone rounds the state's updates to 10 mantissa bits, an error the recurrence carries along).
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
    prec = "ieee" if interpreting() else "tf32x3"
    # Both chunk kernels hold several fp32 [64, Dk] and [64, 64] tiles at once (q, k, A, P, T): 8 warps keep them
    # in registers at Dk = 128 (an estimate from the tile sizes, not from a ptxas report).
    warps = 4 if block_k <= 64 else 8
    tri = torch.empty(tokens, v_heads, CHUNK, dtype=torch.float32, device=v.device)
    intra = torch.empty(tokens, v_heads, CHUNK, dtype=torch.float32, device=v.device)
    cum = torch.empty(tokens, v_heads, dtype=torch.float32, device=v.device)
    if tokens:
        # Sequence b has cdiv(n_b, 64) chunks: at most T // 64 + B over the batch, and at most T.
        _chunk_prepare_kernel[(min(tokens, tokens // CHUNK + num_seqs), v_heads)](
            q, k, a, b, A_log, dt_bias, query_start_loc, tri, intra, cum, num_seqs, *common, a.stride(0),
            b.stride(0), HV=v_heads, DK=dk, BK=block_k, BT=CHUNK, BLOCK_S=triton.next_power_of_2(num_seqs),
            PREC=prec, num_warps=warps)
    # 32 state columns a program: [128, 32] fp32 in registers beside the chunk's [64, 128] q and k.
    block_v = max(16, min(16 if interpreting() else 32, triton.next_power_of_2(dv)))
    _chunk_scan_kernel[(triton.cdiv(dv, block_v), v_heads, num_seqs)](
        q, k, v, b, query_start_loc, state_slots, has_initial_state, tri, intra, cum, ssm_states, out, *common,
        v.stride(0), v.stride(1), b.stride(0), out.stride(0), out.stride(1), ssm_states.stride(0),
        HV=v_heads, DK=dk, DV=dv, BK=block_k, BV=block_v, BT=CHUNK, PREC=prec, num_warps=warps, num_stages=2)
    return out
