"""Paged attention for steps whose sequences each have a few new query rows (speculative verify steps): split-KV,
with a sequence's rows and the query heads of a kv head packed into one tile.

Contract: `extend_attention`'s (kernels/extend_attention.py). Sequence b contributes the query rows
query_start_loc[b]:query_start_loc[b+1] (n_b of them) and has context_lens[b] = c_b tokens in the cache, its new ones
included; its row r sits at position c_b - n_b + r and sees the keys at positions 0..that position. The extend kernel
gives each (query block, query head) its own program streaming the whole context: a verify step of 1 + k rows over a
long context then reads each K/V tile once per query head, from a handful of programs. Here, as in flash-decoding
(kernels/decode_attention.py), the context is split over many programs and each K/V tile is read once per kv head.

Work items. A sequence's rows are cut into query blocks of QB rows, QB = min(max_query_len or T, M_cap // GROUP)
with M_cap = 64 at head_dim 256 and 128 below (`verify_config`), so in a verify step QB >= n_b: one block; a work
item is one (sequence, query block), with rows r0..r1-1 that together see the keys [0, E), E = c_b - n_b + r1. A
program packs the item's QB rows x the GROUP = Hq/Hk query heads of one kv head into the M = next_pow2(QB * GROUP)
(>= 16) rows of the tensor-core dots (tile row m: query row r0 + m // GROUP, head kvh * GROUP + m % GROUP).

Split-KV. Kernel 1, grid (P, Hk): the W work items of the batch are counted on the device from query_start_loc
(padding sequences, with no rows, have none); each item gets S = min(P // W, S_MAX) splits, program p takes item
p // S and split p % S. An item's BLOCK_N-key tiles, cdiv(E, BLOCK_N) of them, are dealt out in runs of
max(cdiv(tiles, S), MIN_TILES) (so a split reads at least MIN_TILES tiles and short contexts use fewer splits); a
split holds per row and head the online softmax over its keys, fp32 in the log2 domain, s = q.k * scale * log2(e):
  m = max_j s_j,  l = sum_j 2^(s_j - m),  o = sum_j 2^(s_j - m) v_j / l,  lse = m + log2(l)  (-inf: no key visible)
and writes o and lse. Keys up to the item's first row's position are visible to all its rows: only the tiles past it
take the causal mask. Kernel 2, grid (T, Hq), finds each row's sequence, recomputes the same plan and merges the
splits: out = sum_s 2^lse_s o_s / sum_s 2^lse_s. 16-bit inputs take tensor-core dots with fp32 accumulation, fp32
(or mixed) inputs exact fp32 dots; an fp8 cache is widened to q's dtype in registers, its K scale joins the softmax
scale and its V scale the output (kernels/kv_fp8.py).

Fixed launch (CUDA-graph capture): nothing above depends on host-side lengths. P = max(cdiv(2 * SMs, Hk), a bound
on W: min(T, cdiv(T, QB) + B)) gives batch 1 about two programs per SM, like decode, whatever the number of padding
sequences; S_MAX = the largest power of two <= min(P, 64). Each program writes its packed rows' partials to rows of
its own, [P, Hk, QB * GROUP] rows of D fp32 (+ the LSEs) in all: sized by shapes alone, and QB * Hq rows per program
index whatever the batch (a [T, Hq, S_MAX] layout would take 64 splits' room for every row of a large eager batch).
Rows past query_start_loc[B] (padding) are left unwritten, as by the extend kernel.

Traffic: each item's K/V keys [0, E) once per kv head (2 * E * Hk * D cache elements; 1 byte each in fp8), q and
out once, and the partials written and read back (2 * rows * Hq * (D + 1) fp32 per split, mostly from L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.attention import (LOG2E, exact_fp32_dots, merge_splits, num_sms, query_operand, tile_scores,
                                       tile_values)
from orinfer.kernels.extend_attention import paged_inputs
from orinfer.kernels.gemv import check_device, interpreting
from orinfer.kernels.kv_fp8 import check_kv_scales
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, small_kernel_prologue, use_pdl

# paged_attention (kernels/decode_attention.py) sends steps of at most this many rows per sequence here.
VERIFY_MAX_ROWS = 16
# A split reads at least this many key tiles. 1 measured best or equal at every shape of run 335 (H200, graphs over
# padded buckets): at a 512-token context, batch 1, 11.0 us against 12.9 for 2 (Qwen3.5-27B heads) and 10.1 against
# 12.1 (Qwen3-8B); equal at 4k and 32k, except 27B at 4k, where 4 gave 19.8 against 22.4.
MIN_SPLIT_TILES = 1
MAX_SPLITS = 64
SEQ_CHUNK = 64  # sequences read per step of the device-side scans of query_start_loc (a constant: no recompiles)


@triton.jit
def _seq_chunk(qsl_ptr, num_seqs, c, QB: tl.constexpr, BLOCK_B: tl.constexpr):
    """Sequences c..c+BLOCK_B-1: (in the batch, query_start_loc[s+1], query blocks of QB rows; 0 past the batch)."""
    s = c + tl.arange(0, BLOCK_B)
    ok = s < num_seqs
    lo = tl.load(qsl_ptr + s, mask=ok, other=0)
    hi = tl.load(qsl_ptr + s + 1, mask=ok, other=0)
    return ok, hi, (hi - lo + QB - 1) // QB


@triton.jit
def _count_items(qsl_ptr, num_seqs, QB: tl.constexpr, BLOCK_B: tl.constexpr):
    """W: the batch's work items (query blocks of QB rows; an empty sequence has none)."""
    total = tl.full((), 0, tl.int32)
    for c in range(0, num_seqs, BLOCK_B):
        ok, hi, blocks = _seq_chunk(qsl_ptr, num_seqs, c, QB, BLOCK_B)
        total += tl.sum(blocks, 0)
    return total


@triton.jit
def _find_item(qsl_ptr, num_seqs, item, QB: tl.constexpr, BLOCK_B: tl.constexpr):
    """(sequence, query block) of work item `item`: items are numbered in sequence order."""
    seq = tl.full((), 0, tl.int32)
    first = tl.full((), 0, tl.int32)  # the item number of that sequence's first block
    before = tl.full((), 0, tl.int32)
    for c in range(0, num_seqs, BLOCK_B):
        ok, hi, blocks = _seq_chunk(qsl_ptr, num_seqs, c, QB, BLOCK_B)
        ends = before + tl.cumsum(blocks, 0)
        done = ok & (ends <= item)  # sequences whose items all come before `item` (a prefix: ends never decrease)
        seq += tl.sum(done.to(tl.int32), 0)
        first = tl.maximum(first, tl.max(tl.where(done, ends, 0), 0))
        before += tl.sum(blocks, 0)
    return seq, item - first


@triton.jit
def _find_row(qsl_ptr, num_seqs, t, QB: tl.constexpr, BLOCK_B: tl.constexpr):
    """(the sequence holding query row t, the number of its first work item); the sequence is num_seqs for a
    padding row past query_start_loc[B]."""
    seq = tl.full((), 0, tl.int32)
    first = tl.full((), 0, tl.int32)
    for c in range(0, num_seqs, BLOCK_B):
        ok, hi, blocks = _seq_chunk(qsl_ptr, num_seqs, c, QB, BLOCK_B)
        done = ok & (hi <= t)  # the sequences before row t's (a prefix: query_start_loc never decreases)
        seq += tl.sum(done.to(tl.int32), 0)
        first += tl.sum(tl.where(done, blocks, 0), 0)
    return seq, first


@triton.jit
def _splits_per_item(n_items, programs, S_MAX: tl.constexpr):
    """S: each work item's share of the programs, at most S_MAX."""
    return tl.maximum(tl.minimum(programs // tl.maximum(n_items, 1), S_MAX), 1)


@triton.jit
def _item_splits(ctx, n_new, q_block, splits, QB: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """Both kernels' plan of one work item: (its key end E, tiles per split, splits that hold tiles)."""
    key_end = ctx - n_new + tl.minimum(n_new, (q_block + 1) * QB)
    n_tiles = tl.cdiv(key_end, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(n_tiles, splits), MIN_TILES)
    return key_end, per_split, tl.cdiv(n_tiles, per_split)


@triton.jit
def _verify_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, keys, key_end, pos, kvh, d,
                 HK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr,
                 FP8: tl.constexpr, scale_log2):
    """One tile of keys [BLOCK_N] for the packed rows at positions `pos` [BLOCK_M] (-1: a padding row)."""
    if MASKED:
        k_ok = keys < key_end
        block = tl.load(bt_row + keys // BS, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & (d < D)[None, :]
    else:  # every key of the tile precedes the item's first row: no bounds to check
        block = tl.load(bt_row + keys // BS).to(tl.int64)
        kv_mask = (d < D)[None, :]
    offs = (block * BS + keys % BS)[:, None] * (HK * D) + kvh * D + d[None, :]
    k = tl.load(kc_ptr + offs, mask=kv_mask, other=0.0)
    if FP8:  # e4m3 values are exact in q's dtype; the scales apply outside the dots
        k = k.to(q.dtype)
    s = tile_scores(q, k, scale_log2, DOT_F32)
    if MASKED:
        s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
    # A row may see no key of this tile, nor of the split's earlier ones (a later split than its position, or a
    # padding row): its max stays -inf, and the exponentials are then taken against 0, which keeps them 0, not NaN.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(vc_ptr + offs, mask=kv_mask, other=0.0)
    if FP8:
        v = v.to(q.dtype)
    return m_new, l_i, acc * alpha[:, None] + tile_values(p, v, DOT_F32)


@triton.jit
def _verify_split(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, part_o_ptr, part_lse_ptr, seq, start, n_new, ctx,
                  q_block, kvh, p, split, key_end, per_split, scale_log2, stride_qt, stride_qh, stride_bt,
                  HK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GROUP: tl.constexpr, QB: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
                  FP8: tl.constexpr, PDL: tl.constexpr):
    """One split of one work item and kv head: the packed rows' partial output and log-sum-exp."""
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    r = q_block * QB + m // GROUP
    heads = kvh * GROUP + m % GROUP
    row_ok = (m < QB * GROUP) & (r < n_new)
    pos = tl.where(row_ok, ctx - n_new + r, -1)
    rows = (start + r).to(tl.int64)
    qd_mask = row_ok[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)
    q, scale_log2 = query_operand(q, ks_ptr, kvh, scale_log2, DOT_F32, FP8)  # fp8: V's scale goes on the output
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, tl.cdiv(key_end, BLOCK_N))
    # Tiles whose keys all lie at or before the item's first row's position need no mask.
    open_hi = tl.minimum(tl.maximum((ctx - n_new + q_block * QB + 1) // BLOCK_N, tile_lo), tile_hi)
    for tile in range(tile_lo, open_hi):
        m_i, l_i, acc = _verify_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, tile * BLOCK_N + offs_n, key_end, pos,
                                     kvh, d, HK, D, BS, False, DOT_F32, FP8, scale_log2)
    for tile in range(open_hi, tile_hi):
        m_i, l_i, acc = _verify_tile(q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, tile * BLOCK_N + offs_n, key_end, pos,
                                     kvh, d, HK, D, BS, True, DOT_F32, FP8, scale_log2)
    if PDL:  # the main loop is done: let the combine launch while this program writes
        gdc_launch_dependents()
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if FP8:
        o = o * tl.load(vs_ptr + kvh)
    idx = (p.to(tl.int64) * HK + kvh) * (QB * GROUP) + m  # the program's own partial rows
    tl.store(part_o_ptr + idx[:, None] * D + d[None, :], o, mask=qd_mask)
    tl.store(part_lse_ptr + idx, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)


# Integer arguments that vary per step or batch are not specialised on (Triton compiles a variant per class of value).
@triton.jit(do_not_specialize=["num_seqs", "programs", "stride_bt"])
def _verify_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, qsl_ptr, part_o_ptr, part_lse_ptr, num_seqs,
                   programs, scale_log2, stride_qt, stride_qh, stride_bt,
                   HK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GROUP: tl.constexpr, QB: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
                   S_MAX: tl.constexpr, MIN_TILES: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
                   PDL: tl.constexpr):
    if PDL:  # q and the new tokens' K/V come from the kernels before (kernels/pdl.py)
        gdc_wait()
    p = tl.program_id(0)
    kvh = tl.program_id(1)
    n_items = _count_items(qsl_ptr, num_seqs, QB, BLOCK_B)
    splits = _splits_per_item(n_items, programs, S_MAX)
    item = p // splits
    split = p % splits
    if item < n_items:
        seq, q_block = _find_item(qsl_ptr, num_seqs, item, QB, BLOCK_B)
        start = tl.load(qsl_ptr + seq)
        n_new = tl.load(qsl_ptr + seq + 1) - start
        ctx = tl.load(ctx_ptr + seq)
        key_end, per_split, active = _item_splits(ctx, n_new, q_block, splits, QB, BLOCK_N, MIN_TILES)
        if split < active:
            _verify_split(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, part_o_ptr, part_lse_ptr, seq, start, n_new,
                          ctx, q_block, kvh, p, split, key_end, per_split, scale_log2, stride_qt, stride_qh,
                          stride_bt, HK, D, BS, GROUP, QB, BLOCK_M, BLOCK_N, BLOCK_D, DOT_F32, FP8, PDL)


@triton.jit(do_not_specialize=["num_seqs", "programs"])
def _verify_combine_kernel(part_o_ptr, part_lse_ptr, ctx_ptr, qsl_ptr, out_ptr, num_seqs, programs, stride_ot,
                           stride_oh, HK: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                           QB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
                           S_MAX: tl.constexpr, MIN_TILES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        small_kernel_prologue()
    t = tl.program_id(0)
    h = tl.program_id(1)
    seq, first = _find_row(qsl_ptr, num_seqs, t, QB, BLOCK_B)
    start = tl.load(qsl_ptr + seq, mask=seq < num_seqs, other=0)
    n_new = tl.load(qsl_ptr + seq + 1, mask=seq < num_seqs, other=0) - start
    if seq < num_seqs:
        n_items = _count_items(qsl_ptr, num_seqs, QB, BLOCK_B)
        ctx = tl.load(ctx_ptr + seq)
        q_block = (t - start) // QB
        splits = _splits_per_item(n_items, programs, S_MAX)
        _, _, active = _item_splits(ctx, n_new, q_block, splits, QB, BLOCK_N, MIN_TILES)
        # Split s of the item ran as program (first + q_block) * splits + s; its partial rows are packed as there.
        m = (t - start - q_block * QB) * GROUP + h % GROUP
        base = (((first + q_block) * splits).to(tl.int64) * HK + h // GROUP) * (QB * GROUP) + m
        out = merge_splits(part_o_ptr, part_lse_ptr, base, HK * QB * GROUP, active, D, S_MAX, BLOCK_D)
        d = tl.arange(0, BLOCK_D)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < D)


def verify_config(tokens: int, rows: int, group: int, head_dim: int, dot_f32: bool, fp8: bool) -> dict:
    """Tile sizes for a step of `tokens` rows and at most `rows` per sequence: QB (rows per work item: as many as
    BLOCK_M holds), BLOCK_M (the next power of two >= 16 of min(rows, tokens) * GROUP packed), BLOCK_N (keys per
    tile), BLOCK_D, warps and stages. From the other attention kernels'
    tiles (64 x 32 for head_dim 256, up to 128 x 64 below) and ptxas reports for sm_90 without spills
    (tests/test_verify_attention_codegen.py): fp8 tiles at head_dim 256 take 16 keys (with 32, widening them to
    fp16 spilled), exact fp32 dots (FMA loops) 32 rows; the interpreter small tiles (short tests cross many)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if interpreting():
        max_m, block_n = 32, 16
    elif dot_f32:
        max_m, block_n = 32, 16 if block_d > 128 else 32
    elif block_d > 128:
        max_m, block_n = 64, 16 if fp8 else 32
    else:
        max_m, block_n = 128, 64
    # The tile holds the packed rows; QB is then as many rows as it fits, not the step's exact count: one kernel per
    # tile height rather than per row count (2 .. 16 rows a sequence were 15 kernels, each compiled on first use in
    # the middle of a request; tests/test_gpu_startup_compiles.py), with the same tiles and work items.
    needed = max(1, min(rows, tokens, max_m // group))
    block_m = max(16, triton.next_power_of_2(needed * group))
    qb = max(needed, min(block_m, max_m) // group)
    warps = 8 if block_m * block_d >= 128 * 128 or (dot_f32 and block_d > 128) else 4
    return dict(QB=qb, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=2)


def verify_grid(tokens: int, qb: int, num_seqs: int, kv_heads: int, sms: int,
                num_programs: int | None = None) -> tuple[int, int]:
    """(P, S_MAX) of a launch (the module docstring): P programs per kv head, about two per SM at batch 1 and at
    least one per work item; S_MAX, the split bound and the combine's tile (a constexpr)."""
    max_items = min(tokens, triton.cdiv(tokens, qb) + num_seqs)
    programs = max(num_programs or triton.cdiv(2 * sms, kv_heads), max_items)
    s_max = min(programs, MAX_SPLITS)
    return programs, 1 << (s_max.bit_length() - 1)  # a power of two: the combine's tile


def verify_row_classes(group: int, head_dim: int, dot_f32: bool, fp8: bool) -> list[int]:
    """The fewest rows a sequence of a one-sequence step has for each distinct `verify_config` over 2 ..
    VERIFY_MAX_ROWS rows: what a start-up warm-up runs so that no row count compiles a kernel on first use."""
    firsts: dict[tuple, int] = {}
    for rows in range(2, VERIFY_MAX_ROWS + 1):
        firsts.setdefault(tuple(sorted(verify_config(rows, rows, group, head_dim, dot_f32, fp8).items())), rows)
    return sorted(firsts.values())


def verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                     max_query_len: int | None = None, fixed_launch: bool = False, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, num_programs: int | None = None,
                     min_split_tiles: int = MIN_SPLIT_TILES) -> torch.Tensor:
    """`paged_attention_ref`'s contract (as `extend_attention`): q [T, Hq, D] (unit last stride), caches [blocks,
    block_size, Hk, D] (contiguous), block_tables [B, W] int32, context_lens [B] and query_start_loc [B+1] int32 ->
    [T, Hq, D] in q's dtype; rows past query_start_loc[B] are left unwritten; fp8 caches with k_scale, v_scale [Hk].

    Made for steps of few rows per sequence (the module docstring: work items, splits, grid). Any batch is correct:
    max_query_len (rows per sequence; T when None) only sizes the query blocks, and the launch always depends on the
    shapes alone, so fixed_launch (CUDA-graph capture with padding rows and empty sequences) needs nothing more.
    num_programs (per kv head; default about two per SM at batch 1) and min_split_tiles: for tests and benchmarks.
    """
    check_device(q)
    fp8 = check_kv_scales("verify_attention", k_cache, k_scale, v_scale)
    q, block_tables = paged_inputs("verify_attention", q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    tokens, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0 or num_seqs == 0:
        return out
    group = heads // kv_heads
    dot_f32 = exact_fp32_dots(q.dtype, k_cache.dtype)
    rows = tokens if max_query_len is None else max(1, min(max_query_len, tokens))
    cfg = verify_config(tokens, rows, group, head_dim, dot_f32, fp8)
    qb = cfg["QB"]
    programs, s_max = verify_grid(tokens, qb, num_seqs, kv_heads, num_sms(q.device), num_programs)
    part_rows = programs * kv_heads * qb * group  # each program's packed rows (bounded by shapes; few used)
    part_o = torch.empty(part_rows, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(part_rows, dtype=torch.float32, device=q.device)
    pdl = use_pdl(q)
    _verify_kernel[(programs, kv_heads)](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, block_tables, context_lens,
        query_start_loc, part_o, part_lse, num_seqs, programs, scale * LOG2E, q.stride(0), q.stride(1),
        block_tables.stride(0), HK=kv_heads, D=head_dim, BS=block_size, GROUP=group, BLOCK_B=SEQ_CHUNK,
        S_MAX=s_max, MIN_TILES=max(1, int(min_split_tiles)), DOT_F32=dot_f32, FP8=fp8, PDL=pdl, launch_pdl=pdl, **cfg)
    _verify_combine_kernel[(tokens, heads)](
        part_o, part_lse, context_lens, query_start_loc, out, num_seqs, programs, out.stride(0), out.stride(1),
        HK=kv_heads, D=head_dim, GROUP=group, QB=qb, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
        BLOCK_B=SEQ_CHUNK, S_MAX=s_max, MIN_TILES=max(1, int(min_split_tiles)), PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out
