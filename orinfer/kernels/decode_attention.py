"""Paged decode attention (flash-decoding): one new query token per sequence against its cached keys and values.

Split-K over the context: a first kernel gives each (sequence, kv head, split) program a contiguous share of the
context's tiles, gathered through the block table, and writes a normalised partial output with its log-sum-exp; a
second kernel merges the splits. Each program loads a K/V tile once for all the query heads of its kv head (GQA).
Softmax math is fp32 in the log2 domain; 16-bit caches use tensor-core dots with fp32 accumulation, fp32 caches exact
fp32 dots. The cache layout and the reference (`paged_attention_ref`) are in `kernels/attention.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.attention import LOG2E, exact_fp32_dots, fp16_dot_operand, merge_splits, num_sms
from orinfer.kernels.extend_attention import extend_attention
from orinfer.kernels.gemv import check_device
from orinfer.kernels.kv_fp8 import check_kv_scales
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, small_kernel_prologue, use_pdl
from orinfer.kernels.verify_attention import VERIFY_MAX_ROWS, verify_attention


class DecodeTile(NamedTuple):
    """A launch tile of the flash-decoding kernel: `block_n` context tokens per loop step (a [BLOCK_N, D] K and V
    tile each), Triton's `stages` of software pipelining (loads of the next tiles in flight), `warps` per program."""
    block_n: int
    stages: int
    warps: int


def default_tile(head_dim: int, fp8: bool, dot_f32: bool, programs: int = 0, sms: int = 0) -> DecodeTile:
    """The tile `paged_decode_attention` runs when given none. `programs` is batch x kv heads (the grid before
    splitting), `sms` the device's SM count (0: unknown). Register budgets from ptxas reports for sm_90 (<= 128 a
    thread, no spills): exact fp32 dots are FMA loops, hence their small tiles at head_dim > 128.

    16-bit caches at head_dim <= 128, from the H200 sweep at Qwen3-8B's heads (NOTES run 376,
    `decode-attention-sweep-h200-run376.md`; us a layer, this rule against the former 64-token, 2-stage tile):
    - at least 2 programs per SM (batch 64): 32-token tiles, 3 stages: ctx 528 37.4 against 39.9, ctx 2048 125.8 / 127.5;
    - fewer: 64-token tiles, 3 stages: batch 8 ctx 2048 23.1 / 27.5, batch 32 ctx 1024 (one split) 36.4 / 41.0;
    - at most one program per 8 SMs (batch 1): 4 stages: ctx 4096 10.2 / 11.4, ctx 32k 38.6 / 45.5."""
    if triton.next_power_of_2(head_dim) > 128:
        return DecodeTile(16 if dot_f32 else 32, 2, 4)
    if fp8 and not dot_f32:
        # 128-token fp8 tiles (the bytes of a 64-token bf16 tile), 3 stages: 31.7 us per layer at a 32k context,
        # batch 1, Qwen3-8B's heads, against 51.9 with the bf16 tiles and 42.8 for the bf16 cache (H200).
        return DecodeTile(128, 3, 4)
    if dot_f32 or not sms:
        return DecodeTile(64, 2, 4)
    if programs >= 2 * sms:
        return DecodeTile(32, 3, 4)
    return DecodeTile(64, 4 if programs * 8 <= sms else 3, 4)


def check_tile(tile: DecodeTile) -> None:
    """Raises ValueError for a tile the kernel cannot run. block_n: a power of two (tl.arange) from 16 (tl.dot's
    smallest N and K: the [G, BLOCK_N] scores and the [BLOCK_N, D] V tile) to 256 (a 256 x 128 bf16 K tile is
    already 128 registers a thread at 4 warps). Tokens are gathered one by one through the block table (block id
    tok // BS, row tok % BS), so a tile may span several cache blocks or part of one: no relation to the cache's
    block size is needed. stages: 1 (no pipelining) to 8; warps: a power of two from 1 to 16."""
    block_n, stages, warps = tile
    if not (isinstance(block_n, int) and 16 <= block_n <= 256 and block_n & (block_n - 1) == 0):
        raise ValueError(f"paged_decode_attention: tile block_n {block_n!r} must be a power of two in [16, 256]")
    if not (isinstance(stages, int) and 1 <= stages <= 8):
        raise ValueError(f"paged_decode_attention: tile stages {stages!r} must be in [1, 8]")
    if not (isinstance(warps, int) and 1 <= warps <= 16 and warps & (warps - 1) == 0):
        raise ValueError(f"paged_decode_attention: tile warps {warps!r} must be a power of two in [1, 16]")


def default_num_splits(batch: int, kv_heads: int, max_tiles: int, device: torch.device) -> int:
    """Splits of the context when the caller names none: none once the (sequence, kv head) programs alone give
    every SM one; otherwise enough for ~2 programs per SM, no more than the tiles of the longest possible context
    (`max_tiles`), at most 64 and, past 16, a power of two."""
    sms = num_sms(device)
    if batch * kv_heads >= sms:
        # Two splits at one to two programs per SM measured slower than none (H200, batch 32, 8 kv heads, ctx 1024:
        # bf16 cache 36.4 us against 44.2 with 64-token 3-stage tiles, fp8 cache 30.6 against 35.8; NOTES run 376).
        return 1
    num_splits = min(triton.cdiv(2 * sms, batch * kv_heads), max_tiles, 64)
    if num_splits > 16:
        # The combine pads the splits to a power of two: 33 splits (batch 1, 8 kv heads, 132 SMs) cost it a
        # 64-wide tile and the batch-1 step 0.02 ms more than 32; 32 splits also measured faster than 33 at every
        # context from 256 to 32k tokens (H200; docs/performance.md).
        num_splits = 1 << (num_splits.bit_length() - 1)
    return num_splits


def combine_width(num_splits: int) -> int:
    """The split merge's tile: 16 splits wide up to 16 (a masked lane costs nothing; fewer widths, fewer kernels to
    compile), the next power of two beyond (64 lanes where 33 splits need them cost a batch-1 step 0.02 ms)."""
    return max(16, triton.next_power_of_2(num_splits))


def eager_launch_classes(batches: list[int], widths: list[int], kv_heads: int, head_dim: int, block_size: int,
                         fp8: bool, dot_f32: bool, device: torch.device) -> list[tuple[int, int]]:
    """One (batch, block-table width) per distinct set of kernels that `paged_decode_attention`'s default launch
    takes over these batches and widths: its tile (by batch), whether it splits and the merge's width (by batch and
    width). A start-up warm-up runs these so that an eager decode (speculative proposals off the graphs) compiles
    nothing on first use."""
    firsts: dict[tuple, tuple[int, int]] = {}
    sms = num_sms(device) if device.type == "cuda" else 0
    for batch in batches:
        tile = default_tile(head_dim, fp8, dot_f32, batch * kv_heads, sms)
        # The split count never falls as the table widens, and stops rising at the count of an unbounded context:
        # wider tables from there on take the kernels already found (a 40k-token context over 256 batches was 655k
        # calls, 5 s of start-up on a slow CPU).
        most = default_num_splits(batch, kv_heads, 1 << 30, device)
        for width in sorted(widths):
            splits = default_num_splits(batch, kv_heads, max(1, triton.cdiv(width * block_size, tile.block_n)),
                                        device)
            firsts.setdefault((tile, splits > 1, combine_width(splits) if splits > 1 else 0), (batch, width))
            if splits == most:
                break
    return list(firsts.values())


@triton.jit
def _decode_row(qsl_ptr, b, VARLEN: tl.constexpr):
    """(the query row of sequence b, 1 if b has a row here else 0): row b in a decode batch; with VARLEN (a mixed
    step, `query_start_loc` given) query_start_loc[b], for a sequence of exactly one row (the others belong to
    another kernel)."""
    row = b
    mine = 1
    if VARLEN:
        row = tl.load(qsl_ptr + b)
        mine = (tl.load(qsl_ptr + b + 1) - row == 1).to(tl.int32)
    return row, mine


# Eager batches differ in their block-table width and split count: not specialized on, so they share the kernels that
# start-up compiled (tests/test_gpu_startup_compiles.py).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr, part_o_ptr,
                         part_lse_ptr, HQ, GROUP, num_splits, scale_log2,
                         stride_qb, stride_qh, stride_bt, stride_cblk, stride_ctok, stride_ch, stride_ob, stride_oh,
                         D: tl.constexpr, BS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, VARLEN: tl.constexpr, DOT_F32: tl.constexpr,
                         FP8: tl.constexpr, PDL: tl.constexpr):
    # Under PDL this program may start while the kernel before it (the new token's RoPE and KV store) still runs.
    # The context length and the block table come from the step's inputs, written before any kernel of the step,
    # so they are read before the wait (kernels/pdl.py), taking two dependent loads off the path to the first K/V
    # tile: a batch-1 AWQ step replays in 1.754 ms against 1.772 with them after the wait (H200).
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row, mine = _decode_row(qsl_ptr, b, VARLEN)
    ctx = tl.load(ctx_ptr + b) * mine  # not this kernel's sequence: no tiles, nothing stored
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    tok = tile_lo * BLOCK_N + offs_n
    block = tl.load(bt_row + tok // BS, mask=(tok < ctx) & (tile_lo < tile_hi), other=0).to(tl.int64)
    if PDL:  # q and the new token's K/V are the previous kernel's output
        gdc_wait()

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = (g < GROUP) & (mine > 0)
    d_mask = d < D
    heads = kvh * GROUP + g  # the query heads that read this kv head (GQA): K/V tiles are loaded once for all
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    if FP8:  # an fp8 cache: K's per-head scale joins the softmax scale, V's scales the output (kernels/kv_fp8.py)
        scale_log2 = scale_log2 * tl.load(ks_ptr + kvh)
        v_scale = tl.load(vs_ptr + kvh)
        if not DOT_F32:
            q = fp16_dot_operand(q)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        tok = tile * BLOCK_N + offs_n
        t_mask = tok < ctx
        row = block * stride_cblk + (tok % BS) * stride_ctok + kvh * stride_ch
        nxt = tok + BLOCK_N  # the next tile's blocks, loaded while this one is computed
        block = tl.load(bt_row + nxt // BS, mask=(nxt < ctx) & (tile + 1 < tile_hi), other=0).to(tl.int64)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP8:  # dequantized in registers: e4m3 values are exact in q's dtype, the scales apply outside the dots
            k = k.to(q.dtype)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(t_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every visited tile holds >= 1 valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            v = v.to(q.dtype)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if PDL:  # the main loop is done: let the next kernel launch while this one writes its result
        gdc_launch_dependents()
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty range (context 0, or a split past the end) writes zeros
    o = acc / l_safe[:, None]
    if FP8:
        o = o * v_scale
    o_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        idx = (b * HQ + heads).to(tl.int64) * num_splits + split
        tl.store(part_o_ptr + idx[:, None] * D + d[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + idx, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=g_mask)
    else:
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(part_o_ptr, part_lse_ptr, qsl_ptr, out_ptr, HQ, num_splits, stride_ob, stride_oh,
                           D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
                           PDL: tl.constexpr):
    if PDL:  # see kernels/pdl.py: wait for the previous kernel before touching memory
        small_kernel_prologue()
    b = tl.program_id(0)
    h = tl.program_id(1)
    row, mine = _decode_row(qsl_ptr, b, VARLEN)
    out = merge_splits(part_o_ptr, part_lse_ptr, (b * HQ + h).to(tl.int64) * num_splits, 1, num_splits, D, BLOCK_S,
                       BLOCK_D)
    d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + row.to(tl.int64) * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=(d < D) & (mine > 0))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, num_splits: int | None = None, *,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           tile: DecodeTile | None = None, query_start_loc: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Flash-decoding over the paged cache: one query token per sequence, q [B, Hq, D] -> [B, Hq, D] in q's dtype.

    Query b attends over the first context_lens[b] cached tokens of its sequence (its own included: decode has
    already stored it). Kernel 1, grid (B, Hk, num_splits): a program owns one kv head (so each K/V tile is loaded
    once for all Hq/Hk query heads of the group, padded to 16 rows for the tensor-core dots) and one contiguous
    share of the sequence's BLOCK_N-token tiles; it gathers tokens through the block table, keeps an online
    softmax (fp32, log2 domain) and writes a normalised partial output and its log-sum-exp. Kernel 2, grid (B, Hq),
    merges the splits by their LSE. num_splits = 1 skips kernel 2 (kernel 1 writes the output). Default
    num_splits: enough programs for ~2 per SM, computed from shapes only (block_tables.shape[1] bounds the
    context), so no device->host sync and the launch is CUDA-graph safe; splits past a sequence's end write zeros.
    Any cache block size and any head_dim (masked to the next power of two >= 16) work. An fp8 cache (k_scale,
    v_scale [Hk] fp32) is read as fp8 and widened to q's dtype in registers: the K scale multiplies the scores,
    the V scale the output. `tile` overrides kernel 1's launch tile (`default_tile` when None; `check_tile` says
    which are valid), for benchmarks (bench/decode_attention_sweep.py); the default split rule then counts its tiles.
    Traffic: the context's K and V once (2*ctx*Hk*D elements per sequence; 1 byte each in fp8) + q/out +
    2*splits*Hq*(D+1) fp32.

    A mixed step's decode rows (`paged_attention`): given query_start_loc [B+1], q and out are a step's [T, Hq, D]
    rows and only the B sequences of exactly one row are attended, each at its row query_start_loc[b]; the others'
    rows are left as they are in `out` (written in place when given). The grid stays (B, Hk, splits): shapes only,
    as CUDA-graph capture of padded mixed steps needs.
    """
    check_device(q)
    fp8 = check_kv_scales("paged_decode_attention", k_cache, k_scale, v_scale)
    rows, heads, head_dim = q.shape
    varlen = query_start_loc is not None
    batch = context_lens.shape[0] if varlen else rows
    _, block_size, kv_heads, _ = k_cache.shape
    if (k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim or heads % kv_heads
            or block_tables.shape[0] != batch or context_lens.shape != (batch,)
            or (varlen and query_start_loc.shape != (batch + 1,))
            or (out is not None and out.shape != q.shape)):
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, "
                         f"block_tables {tuple(block_tables.shape)}, context_lens {tuple(context_lens.shape)}"
                         + (f", query_start_loc {tuple(query_start_loc.shape)}" if varlen else "")
                         + (f", out {tuple(out.shape)}" if out is not None else ""))
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_decode_attention: the caches must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    if out is None:
        out = torch.empty(rows, heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_g = max(16, triton.next_power_of_2(group))
    dot_f32 = exact_fp32_dots(q.dtype, k_cache.dtype)
    if tile is None:
        tile = default_tile(head_dim, fp8, dot_f32, batch * kv_heads, num_sms(q.device) if q.is_cuda else 0)
    else:
        tile = DecodeTile(*tile)
        check_tile(tile)
    max_tiles = max(1, triton.cdiv(block_tables.shape[1] * block_size, tile.block_n))
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_tiles, q.device)
    num_splits = max(1, int(num_splits))
    split = num_splits > 1
    if split:
        part_o = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _paged_decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, block_tables, context_lens,
        query_start_loc if varlen else context_lens, out, part_o, part_lse,
        heads, group, num_splits, scale * LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        D=head_dim, BS=block_size, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=tile.block_n, SPLIT=split,
        VARLEN=varlen, DOT_F32=dot_f32, FP8=fp8, num_warps=tile.warps, num_stages=tile.stages, PDL=use_pdl(q),
        launch_pdl=use_pdl(q))
    if split:
        _combine_splits_kernel[(batch, heads)](
            part_o, part_lse, query_start_loc if varlen else part_lse, out, heads, num_splits, out.stride(0),
            out.stride(1), D=head_dim, BLOCK_S=combine_width(num_splits), BLOCK_D=triton.next_power_of_2(head_dim),
            VARLEN=varlen, num_warps=4, PDL=use_pdl(q), launch_pdl=use_pdl(q))
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    max_query_len: int | None = None, fixed_launch: bool = False, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention_ref`'s signature. When there are as many query rows as sequences (decode: one new token
    each; query_start_loc is then taken to be arange(B+1) and is not read, so no sync), the flash-decoding kernel.
    Otherwise, when no sequence can have more than VERIFY_MAX_ROWS rows (at most min(T, max_query_len); with
    `fixed_launch` max_query_len is the graph's token bucket), the split-KV verify kernel
    (`kernels/verify_attention.py`: speculative verify steps, short chunks over a cached prefix); beyond, the extend
    kernel (`kernels/extend_attention.py`: prompt chunks, prefix-cache hits), and, when there may be several
    sequences, the flash-decoding kernel for the decode rows among them. Both take padded mixed-step
    batches (`fixed_launch`)."""
    tokens, num_seqs = q.shape[0], context_lens.shape[0]
    if tokens == num_seqs and not fixed_launch:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                      k_scale=k_scale, v_scale=v_scale)
    if min(tokens, tokens if max_query_len is None else max_query_len) <= VERIFY_MAX_ROWS:
        return verify_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                max_query_len=max_query_len, fixed_launch=fixed_launch, k_scale=k_scale,
                                v_scale=v_scale)
    if num_seqs == 1 and not fixed_launch:
        return extend_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                max_query_len=max_query_len, k_scale=k_scale, v_scale=v_scale)
    # A mixed step: decode rows beside prompt chunks. In the extend kernel each decode row would fill a whole
    # 128-row query tile per query head (H200, Qwen3-8B, 63 decode rows + a 200-token prompt: 197 us a layer, NOTES
    # run 396); the decode kernel, over the step's sequences, attends the one-row ones at their rows, as in a decode
    # step (21 us a layer for 63 rows; run 397's split-KV verify kernel took 27 + a 20 us combine). Only one-row
    # sequences move: chunks of any length keep the extend kernel's tiles and summation order, whatever else shares
    # their step. Each kernel leaves the other's rows alone.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=k_scale, v_scale=v_scale,
                           query_start_loc=query_start_loc, out=out)
    return extend_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                            max_query_len=max_query_len, fixed_launch=fixed_launch, k_scale=k_scale, v_scale=v_scale,
                            rows_above=1, out=out)
