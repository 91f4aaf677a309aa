"""Paged "extend" attention: each sequence's new query tokens attend causally to its cached tokens and themselves.

The step a token-budget scheduler runs mixes sequences of any query length over any cached prefix: a prompt chunk
after earlier chunks, a prompt whose first blocks came from the prefix cache, a verification of speculated tokens, a
decode row (one query). Sequence b contributes the query rows query_start_loc[b]:query_start_loc[b+1] (n_b of them)
and has context_lens[b] tokens in the cache after this step, its new ones included (their K/V are stored before
attention runs). Query j of sequence b sits at position p = context_lens[b] - n_b + j and attends to the keys at
positions 0..p, which live in blocks block_tables[b, pos // block_size] at offsets pos % block_size.

Math (per query row, head h, kv head h // (Hq/Hk)): softmax(q K^T * scale) V over those keys, fp32 online softmax in
the log2 domain; 16-bit inputs take tensor-core dots with fp32 accumulation, fp32 (or mixed) inputs exact fp32 dots.
The reference is `attention.paged_attention_ref` (a Python loop over sequences).

Traffic: q and out once; each query block of BLOCK_M rows streams its sequence's K/V up to its last row's position
(2 * context * Hk * D elements per head group, from L2 for all but the first query block of a sequence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.attention import LOG2E, exact_fp32_dots, online_softmax, query_operand, tile_scores, tile_values
from orinfer.kernels.gemv import check_device, interpreting
from orinfer.kernels.kv_fp8 import check_kv_scales


@triton.jit
def _extend_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, keys, pos, context, kvh, block_size, d,
                 HK: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
                 scale_log2):
    """One tile of cached keys [BLOCK_N] (positions `keys`) for the query rows at positions `pos` [BLOCK_M]."""
    in_context = keys < context
    block = tl.load(bt_row + keys // block_size, mask=in_context, other=0).to(tl.int64)
    slot = block * block_size + keys % block_size
    offs = slot[:, None] * (HK * D) + kvh * D + d[None, :]
    kv_mask = in_context[:, None] & (d < D)[None, :]
    k = tl.load(kc_ptr + offs, mask=kv_mask, other=0.0)
    if FP8:  # dequantized in registers: e4m3 values are exact in q's dtype, the scales apply outside the dots
        k = k.to(q.dtype)
    s = tile_scores(q, k, scale_log2, DOT_F32)
    if MASKED:
        s = tl.where((keys[None, :] <= pos[:, None]) & in_context[None, :], s, float("-inf"))
    m_new, alpha, p, l_i = online_softmax(s, m_i, l_i)  # finite: every row's first tile holds key 0 <= its position
    v = tl.load(vc_ptr + offs, mask=kv_mask, other=0.0)
    if FP8:
        v = v.to(q.dtype)
    return m_new, l_i, acc * alpha[:, None] + tile_values(p, v, DOT_F32)


@triton.jit
def _extend_rows(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr, seq, m_block, h, GROUP,
                 block_size, scale_log2, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh, rows_above,
                 HK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr):
    """Query rows m_block*BLOCK_M.. of sequence `seq` (those it has), head h: attention over its paged context
    (nothing when the sequence has at most `rows_above` rows)."""
    start = tl.load(qsl_ptr + seq)
    n_new = tl.load(qsl_ptr + seq + 1) - start
    m0 = m_block * BLOCK_M
    if (m0 < n_new) & (n_new > rows_above):
        context = tl.load(ctx_ptr + seq)
        kvh = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < n_new
        pos = context - n_new + offs_m  # rows past n_new sit beyond the context: masked at the store
        rows = (start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=m_mask[:, None] & (d < D)[None, :], other=0.0)
        q, scale_log2 = query_operand(q, ks_ptr, kvh, scale_log2, DOT_F32, FP8)  # fp8: V's scale goes on the output
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        offs_n = tl.arange(0, BLOCK_N)
        # Keys before the block's first query position are visible to every row: whole tiles of them need no mask.
        # The tiles from there to the last row's position (or the context's end) get the causal and length masks.
        first = context - n_new + m0
        open_end = first // BLOCK_N * BLOCK_N
        for n0 in range(0, open_end, BLOCK_N):
            m_i, l_i, acc = _extend_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, n0 + offs_n, pos, context, kvh,
                                         block_size, d, HK, D, False, DOT_F32, FP8, scale_log2)
        for n0 in range(open_end, tl.minimum(context, first + BLOCK_M), BLOCK_N):
            m_i, l_i, acc = _extend_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, n0 + offs_n, pos, context, kvh,
                                         block_size, d, HK, D, True, DOT_F32, FP8, scale_log2)
        o = acc / l_i[:, None]
        if FP8:
            o = o * tl.load(vs_ptr + kvh)
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & (d < D)[None, :])


# num_seqs and rows_above are not specialised on (Triton compiles a kernel per class of integer argument: 1, multiple of
# 16, other): a batch of a new size must not compile a variant mid-serving.
@triton.jit(do_not_specialize=["num_seqs", "rows_above"])
def _extend_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr, num_seqs, GROUP,
                   block_size, scale_log2, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh, rows_above,
                   HK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr, FIXED: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    if FIXED:
        # Grid (tile bound, Hq): the batch's query blocks numbered in sequence order; this program finds its own
        # sequence from the per-sequence block counts (a cumsum over at most BLOCK_S sequences), so the launch
        # depends on no host-side lengths. Programs past the last block do nothing; sequences of at most
        # `rows_above` rows have no blocks here.
        h = tl.program_id(1)
        tile = tl.num_programs(0) - 1 - tl.program_id(0)  # later sequences (prompt chunks: most keys) first
        s = tl.arange(0, BLOCK_S)
        in_batch = s < num_seqs
        lo = tl.load(qsl_ptr + s, mask=in_batch, other=0)
        hi = tl.load(qsl_ptr + s + 1, mask=in_batch, other=0)
        blocks = tl.where(hi - lo > rows_above, (hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
        ends = tl.cumsum(blocks, 0)
        seq = tl.sum((ends <= tile).to(tl.int32), 0)
        if seq < num_seqs:
            m_block = tile - tl.sum(tl.where(s == seq, ends - blocks, 0), 0)
            _extend_rows(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr, seq, m_block, h,
                         GROUP, block_size, scale_log2, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
                         rows_above, HK, D, BLOCK_M, BLOCK_N, BLOCK_D, DOT_F32, FP8)
    else:
        # Grid (cdiv(max_query_len, BLOCK_M), B, Hq); the query blocks with most keys are scheduled first.
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)
        _extend_rows(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr, tl.program_id(1),
                     m_block, tl.program_id(2), GROUP, block_size, scale_log2, stride_qt, stride_qh, stride_bt,
                     stride_ot, stride_oh, rows_above, HK, D, BLOCK_M, BLOCK_N, BLOCK_D, DOT_F32, FP8)


def paged_inputs(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ValueError (naming `op`) unless q [T, Hq, D], the contiguous caches [blocks, block_size, Hk, D] (Hk dividing
    Hq), block_tables [B, W], context_lens [B] and query_start_loc [B+1] agree; q and block_tables with a unit last
    stride (copied if not)."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if (k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim or heads % kv_heads
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError(f"{op}: q {tuple(q.shape)} against contiguous caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} of matching head_dim and a kv-head count dividing q's heads")
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"{op}: {num_seqs} context lengths, query_start_loc {tuple(query_start_loc.shape)}, "
                         f"block tables {tuple(block_tables.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    return q, block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                     max_query_len: int | None = None, fixed_launch: bool = False, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, rows_above: int = 0,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention_ref`'s contract in one launch: q [T, Hq, D] (unit last stride), caches [blocks, block_size,
    Hk, D] (contiguous), block_tables [B, W] int32, context_lens [B] and query_start_loc [B+1] int32 -> [T, Hq, D].

    Kernel: a program holds BLOCK_M query rows of one sequence and head and streams that sequence's paged K/V tiles up
    to its last row's position. Grid (cdiv(max_query_len, BLOCK_M), B, Hq); `max_query_len` (a host int) spares the
    device-to-host sync of reading it from query_start_loc.

    fixed_launch (CUDA-graph capture of mixed steps): the grid depends on the shapes alone, (min(T, cdiv(T, BLOCK_M)
    + B), Hq), enough for any split of T rows over B sequences, and each program finds its query block from
    query_start_loc on the device. Rows past query_start_loc[B] (padding) are left unwritten, and sequences may be
    empty (padding).

    An fp8 cache (k_scale, v_scale [Hk] fp32, `kernels/kv_fp8.py`): tiles are read as fp8 and widened to q's dtype
    in registers; the K scale multiplies the scores, the V scale the output.

    rows_above: only sequences with more query rows than this are attended; the others' rows are left unwritten (a
    mixed step gives its decode rows to another kernel: `decode_attention.paged_attention`). out: written in place
    ([T, Hq, D] in q's dtype) instead of a new tensor.
    """
    check_device(q)
    fp8 = check_kv_scales("extend_attention", k_cache, k_scale, v_scale)
    q, block_tables = paged_inputs("extend_attention", q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    tokens, heads, head_dim = q.shape
    kv_heads, num_seqs = k_cache.shape[2], context_lens.shape[0]
    if out is None:
        out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0 or num_seqs == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    dot_f32 = exact_fp32_dots(q.dtype, k_cache.dtype)
    # The varlen prefill kernel's tiles (the same dots and softmax): wgmma-sized for 16-bit inputs, 16x16 for exact
    # fp32 dots (FMA loops that spill beyond) and in the interpreter (short test sequences then cross tiles).
    if interpreting() or dot_f32:
        block_m, block_n, warps, stages = 16, 16, 4, 2
    elif block_d <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    if fixed_launch:
        grid = (min(tokens, triton.cdiv(tokens, block_m) + num_seqs), heads)
    else:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # one sync
        grid = (triton.cdiv(max_query_len, block_m), num_seqs, heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, block_tables, context_lens,
        query_start_loc, out, num_seqs, heads // kv_heads,
        k_cache.shape[1], scale * LOG2E, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1), rows_above, HK=kv_heads, D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_F32=dot_f32, FP8=fp8, FIXED=fixed_launch, BLOCK_S=triton.next_power_of_2(num_seqs) if fixed_launch else 1,
        num_warps=warps, num_stages=stages)
    return out
