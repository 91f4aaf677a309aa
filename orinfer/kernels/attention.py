"""Attention over the paged KV cache, and the store of new K/V into it.

Cache layout (per layer): k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]. Token t of a sequence
lives in block block_table[t // block_size] at offset t % block_size; its flat slot is block*block_size + offset.
An fp8 cache (float8_e4m3fn) comes with k_scale, v_scale [kv_heads] fp32: stored = x / scale, saturated
(`kernels/kv_fp8.py`); every store and attention op takes them as keywords (None for 16/32-bit caches).

One reference covers prefill, decode and recompute after preemption: sequence i contributes the query rows
query_start_loc[i]:query_start_loc[i+1] (its newest tokens) and attends over its first context_lens[i] cached
tokens, causally: query j (of n) sits at position context_len - n + j and sees keys at positions <= its own.

Triton kernels (below the references): `store_kv`; `varlen_attention` (causal flash attention over concatenated
prompts, for prefill). Decode attention over the paged cache is in `kernels/decode_attention.py`. All softmax math
is fp32 in the log2 domain; 16-bit inputs use tensor-core dots with fp32 accumulation, fp32 inputs exact fp32 dots.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device, cuda_sm_count, interpreting
from orinfer.kernels.kv_fp8 import check_kv_scales, dequantize_kv_ref, quantize_kv_ref, quantize_to_cache
from orinfer.kernels.pdl import small_kernel_prologue, use_pdl

LOG2E = 1.4426950408889634


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Writes k, v [T, kv_heads, D] into the caches at the flat slots [T] (int64). Slots < 0 are skipped. An fp8
    cache stores `quantize_kv_ref(x, scale)`."""
    fp8 = check_kv_scales("store_kv", k_cache, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k, v = k[keep], v[keep]
    if fp8:
        k, v = quantize_kv_ref(k, k_scale), quantize_kv_ref(v, v_scale)
    k_cache.view(-1, kv_heads, head_dim)[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, kv_heads, head_dim)[slots] = v.to(v_cache.dtype)


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [n, Hq, D] over k, v [L, Hk, D] (L >= n, the last n keys are the queries' own), causal, fp32.

    GQA: query head h reads kv head h // (Hq / Hk). Returns [n, Hq, D] in q's dtype.
    """
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    group = heads // kv_heads
    qf = q.float().transpose(0, 1)                                   # [Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale            # [Hq, n, L]
    query_pos = torch.arange(length - n, length, device=q.device)[:, None]
    key_pos = torch.arange(length, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)            # [Hq, n, D]
    return out.transpose(0, 1).to(q.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                        max_query_len: int | None = None, fixed_launch: bool = False,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (all sequences' new tokens, concatenated); returns [T, Hq, D]. max_query_len and fixed_launch:
    for signature parity with the kernels (launch details), not needed here; rows past query_start_loc[-1] (padding)
    are left unwritten. An fp8 cache is dequantized (`dequantize_kv_ref`) to q's dtype before the math."""
    fp8 = check_kv_scales("paged_attention", k_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    starts = query_start_loc.tolist()
    for i, length in enumerate(context_lens.tolist()):
        begin, end = starts[i], starts[i + 1]
        if end == begin:
            continue
        blocks = block_tables[i, : (length + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:length]
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:length]
        if fp8:
            k, v = dequantize_kv_ref(k, k_scale), dequantize_kv_ref(v, v_scale)  # fp32, as the math below
        out[begin:end] = causal_attention_ref(q[begin:end], k, v, scale)
    return out


def varlen_causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                query_start_loc: torch.Tensor, scale: float, *, max_seqlen: int | None = None
                                ) -> torch.Tensor:
    """Causal attention within each segment of concatenated sequences (prefill, training, warm-up).
    max_seqlen is accepted for signature parity with the Triton kernel and not needed here."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for begin, end in zip(starts[:-1], starts[1:]):
        if end > begin:
            out[begin:end] = causal_attention_ref(q[begin:end], k[begin:end], v[begin:end], scale)
    return out


# --- Triton: KV store -------------------------------------------------------------------------------------------------

@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, HK, stride_kt, stride_kh, stride_vt,
                     stride_vh, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # see kernels/pdl.py: wait for the previous kernel before touching memory
        small_kernel_prologue()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    mask = (h < HK)[:, None] & (d < D)[None, :] & (slot >= 0)
    dst = slot * HK * D + h[:, None] * D + d[None, :]
    # both loads before the first store: the compiler cannot tell them apart, and would wait for the first store
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if FP8:  # per-head scales (kernels/kv_fp8.py)
        k_s = tl.load(ks_ptr + h, mask=h < HK, other=1.0)[:, None]
        v_s = tl.load(vs_ptr + h, mask=h < HK, other=1.0)[:, None]
        tl.store(kc_ptr + dst, quantize_to_cache(k, k_s), mask=mask)
        tl.store(vc_ptr + dst, quantize_to_cache(v, v_s), mask=mask)
    else:
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def check_kv_target(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, tokens: int,
                    kv_heads: int, head_dim: int) -> None:
    """ValueError unless the caches are contiguous [blocks, block_size, kv_heads, head_dim] and there is one slot per
    token (shared by `store_kv` and the KV store fused into `rotary.qk_norm_rope`)."""
    if (k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (kv_heads, head_dim)
            or slot_mapping.shape != (tokens,)):
        raise ValueError(f"{op}: cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)} and slots "
                         f"{tuple(slot_mapping.shape)} do not match {tokens} tokens of {kv_heads} kv heads x "
                         f"{head_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op}: the caches must be contiguous")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Triton `store_kv_ref`: k, v [T, kv_heads, D] (unit last stride; token/head strides free, e.g. views of the
    packed qkv output) into the contiguous caches at flat slots [T] (int32/int64); slots < 0 are skipped.

    Kernel: grid (T, cdiv(Hk, BLOCK_H)); a program copies BLOCK_H heads of one token's K and V (converted to the
    cache dtype; an fp8 cache: divided by the head's scale, saturated to +-448, rounded to nearest even).
    Traffic: 2*T*Hk*D read + written (written: 1 byte each for fp8).
    """
    fp8 = check_kv_scales("store_kv", k_cache, k_scale, v_scale)
    check_device(k)
    tokens, kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"store_kv: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    check_kv_target("store_kv", k_cache, v_cache, slot_mapping, tokens, kv_heads, head_dim)
    if tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(kv_heads), 4096 // block_d))
    _store_kv_kernel[(tokens, triton.cdiv(kv_heads, block_h))](
        k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else k, v_scale if fp8 else v, kv_heads, k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), D=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, FP8=fp8, num_warps=4,
        PDL=use_pdl(k), launch_pdl=use_pdl(k))


def exact_fp32_dots(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether the attention dots run as exact fp32 dots (fp32 or mixed inputs, or the interpreter, whose bf16
    dot is wrong) rather than 16-bit tensor-core dots with fp32 accumulation. An fp8 cache counts as q's dtype:
    its tiles are widened to it in registers before the dots."""
    if b == torch.float8_e4m3fn:
        b = a
    return a != b or a == torch.float32 or interpreting()


# --- Triton: varlen causal flash attention (prefill) ------------------------------------------------------------------

@triton.jit
def tile_scores(q, k, scale_log2, DOT_F32: tl.constexpr):
    """q [M, D] . k [N, D]^T * scale, in the log2 domain (fp32): exact fp32 dots, or 16-bit tensor-core dots."""
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s * scale_log2


@triton.jit
def fp16_dot_operand(q):
    """q for tensor-core dots against fp8 K/V tiles: fp16, clamped to its range. e4m3 widens to fp16 in one
    instruction (to bf16 in several: the fp8 decode kernel measured 52 us against 44 per layer at a 32k context on
    the H200), and fp16 holds bf16 values of that range exactly (below 2^-14 with less precision: negligible in a
    dot) and the probabilities p, which then follow q's dtype, more precisely."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def query_operand(q, ks_ptr, kvh, scale_log2, DOT_F32: tl.constexpr, FP8: tl.constexpr):
    """(q as the score dots take it, the log2-domain score scale): fp32 for exact dots; against an fp8 cache the fp16
    operand (`fp16_dot_operand`), and K's per-head scale joined to the softmax scale (kernels/kv_fp8.py)."""
    if DOT_F32:
        q = q.to(tl.float32)
    if FP8:
        scale_log2 = scale_log2 * tl.load(ks_ptr + kvh)
        if not DOT_F32:
            q = fp16_dot_operand(q)
    return q, scale_log2


@triton.jit
def online_softmax(s, m_i, l_i):
    """One tile of the online softmax: the new row maxima, the rescale of what was accumulated, the tile's
    probabilities p = 2^(s - max) and the new row sums."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def tile_values(p, v, DOT_F32: tl.constexpr):
    """p [M, N] . v [N, D] with fp32 accumulation."""
    if DOT_F32:
        return tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return tl.dot(p.to(v.dtype), v)


@triton.jit
def merge_splits(part_o_ptr, part_lse_ptr, base, split_stride, num_splits, D: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Split-KV merge of one row and head: the normalised partial outputs of splits s < num_splits, rows i = base +
    s * split_stride of part_o (fp32, rows of D), weighted by 2^lse with their log2-domain log-sum-exps part_lse[i]
    (-inf: a split with no key for this row) -> [BLOCK_D] fp32; zeros when every split is empty."""
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    rows = base + s * split_stride
    lse = tl.load(part_lse_ptr + rows, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    denom = tl.where(denom > 0, denom, 1.0)
    o = tl.load(part_o_ptr + rows[:, None] * D + d[None, :], mask=s_mask[:, None] & (d < D)[None, :], other=0.0)
    return tl.sum(o * w[:, None], axis=0) / denom


def num_sms(device: torch.device) -> int:
    """The device's SM count (4 off CUDA: the interpreter), which split-KV kernels size their grids by."""
    return cuda_sm_count(device) or 4


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_base, v_base, keys, offs_m, d, length, stride_kt, stride_vt, scale_log2,
                 D: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr):
    """One key tile of the online softmax: updates (m_i, l_i, acc) with keys [BLOCK_N] of the segment."""
    if MASKED:
        kv_mask = (keys < length)[:, None] & (d < D)[None, :]
    else:
        kv_mask = (d < D)[None, :]
    k = tl.load(k_base + keys[:, None].to(tl.int64) * stride_kt + d[None, :], mask=kv_mask, other=0.0)
    s = tile_scores(q, k, scale_log2, DOT_F32)
    if MASKED:
        s = tl.where((keys[None, :] <= offs_m[:, None]) & (keys < length)[None, :], s, float("-inf"))
    m_new, alpha, p, l_i = online_softmax(s, m_i, l_i)  # finite: the tile's first key is <= every row's position
    v = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vt + d[None, :], mask=kv_mask, other=0.0)
    return m_new, l_i, acc * alpha[:, None] + tile_values(p, v, DOT_F32)


@triton.jit
def _varlen_fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, GROUP, scale_log2,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                       D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       DOT_F32: tl.constexpr):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (most key tiles) blocks are scheduled first
    seq = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(qsl_ptr + seq)
    length = tl.load(qsl_ptr + seq + 1) - start
    m0 = m_block * BLOCK_M
    if m0 < length:
        kvh = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < length
        d_mask = d < D
        rows_m = (start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows_m[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        k_base = k_ptr + start.to(tl.int64) * stride_kt + kvh * stride_kh
        v_base = v_ptr + start.to(tl.int64) * stride_vt + kvh * stride_vh
        # Key tiles entirely before the query block need no mask (BLOCK_M is a multiple of BLOCK_N, m0 < length);
        # the diagonal tiles get the causal and length masks.
        for n0 in range(0, m0, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_base, v_base, n0 + offs_n, offs_m, d, length,
                                         stride_kt, stride_vt, scale_log2, D, False, DOT_F32)
        for n0 in range(m0, tl.minimum(m0 + BLOCK_M, length), BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_base, v_base, n0 + offs_n, offs_m, d, length,
                                         stride_kt, stride_vt, scale_log2, D, True, DOT_F32)
        o = acc / l_i[:, None]
        tl.store(out_ptr + rows_m[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & d_mask[None, :])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                     *, max_seqlen: int | None = None) -> torch.Tensor:
    """Triton `varlen_causal_attention_ref`: causal flash attention within each segment of concatenated sequences.

    q [T, Hq, D], k/v [T, Hk, D] (unit last stride, other strides free), query_start_loc [B+1] int -> [T, Hq, D].
    Kernel: grid (cdiv(max_seqlen, BLOCK_M), B, Hq); a program holds BLOCK_M query rows of one head and streams
    the segment's key/value tiles up to the diagonal (GQA: kv head = h // (Hq/Hk)) with an fp32 online softmax.
    max_seqlen (host int) avoids the device->host sync that computing it from query_start_loc needs.
    Traffic: q, out once; K/V once per query block (L2-resident for typical prompt lengths).
    """
    check_device(q)
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != (tokens, kv_heads, head_dim) or v.shape != k.shape or heads % kv_heads:
        raise ValueError(f"varlen_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    num_seqs = query_start_loc.shape[0] - 1
    if tokens == 0 or num_seqs <= 0:
        return out
    if max_seqlen is None:
        max_seqlen = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # one sync; fine for a prefill
    if max_seqlen <= 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    dot_f32 = exact_fp32_dots(q.dtype, k.dtype)
    # Tiles chosen from ptxas reports for sm_90: wgmma tiles without spills for 16-bit inputs; exact fp32 dots are
    # FMA loops that spill above 16x16 tiles (fp32 prefill is a correctness mode, not a fast path).
    if interpreting() or dot_f32:
        block_m, block_n, warps, stages = 16, 16, 4, 2  # also: short test sequences cross tiles in the interpreter
    elif block_d <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    _varlen_fwd_kernel[(triton.cdiv(max_seqlen, block_m), num_seqs, heads)](
        q, k, v, out, query_start_loc, heads // kv_heads, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_F32=dot_f32,
        num_warps=warps, num_stages=stages)
    return out
