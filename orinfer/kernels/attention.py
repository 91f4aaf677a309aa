"""Attention over the paged KV cache, and the store of new K/V into it.

Cache layout (per layer): k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]. Token t of a sequence
lives in block block_table[t // block_size] at offset t % block_size; its flat slot is block*block_size + offset.

One reference covers prefill, decode and recompute after preemption: sequence i contributes the query rows
query_start_loc[i]:query_start_loc[i+1] (its newest tokens) and attends over its first context_lens[i] cached
tokens, causally: query j (of n) sits at position context_len - n + j and sees keys at positions <= its own.
"""

from __future__ import annotations

import torch


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Writes k, v [T, kv_heads, D] into the caches at the flat slots [T] (int64). Slots < 0 are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, kv_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)


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
                        context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] (all sequences' new tokens, concatenated); returns [T, Hq, D]."""
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
        out[begin:end] = causal_attention_ref(q[begin:end], k, v, scale)
    return out


def varlen_causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention within each segment of concatenated sequences, without a cache (training, warm-up)."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for begin, end in zip(starts[:-1], starts[1:]):
        if end > begin:
            out[begin:end] = causal_attention_ref(q[begin:end], k[begin:end], v[begin:end], scale)
    return out
