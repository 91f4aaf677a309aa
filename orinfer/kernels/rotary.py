"""Rotary position embedding (RoPE, "rotate half" layout as in Qwen/LLaMA) with an optional per-head RMSNorm first
(Qwen3's q_norm / k_norm).

Math: for head vector x of size D split into halves (x1, x2) and angle theta_i = pos * base^(-2i/D):
  out = (x1*cos - x2*sin, x2*cos + x1*sin). Shapes: q [T, Hq*D], k [T, Hk*D], positions [T] int,
  cos_sin [max_pos, D] fp32 (cos in the first D/2 columns, sin in the last D/2). Partial rotary (Qwen3.5): a table
  of R < D columns turns the first R dims of each head, in pairs (d, d + R/2), and passes the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.attention import check_kv_target, store_kv_ref
from orinfer.kernels.gemv import check_device
from orinfer.kernels.kv_fp8 import check_kv_scales, quantize_to_cache
from orinfer.kernels.norm import rms_norm_ref
from orinfer.kernels.pdl import small_kernel_prologue, use_pdl


def rope_cos_sin_cache(head_dim: int, max_position: int, base: float, device: torch.device | None = None
                       ) -> torch.Tensor:
    """fp32 table [max_position, head_dim]: cos of the D/2 frequencies, then their sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    t = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class KVStore(NamedTuple):
    """Where `qk_norm_rope` also writes this step's K (after the norm and RoPE) and V: the paged caches
    [blocks, block_size, Hk, D] at flat slots [T] (slots < 0 skipped), as `store_kv` does; an fp8 cache with its
    per-head scales [Hk] fp32 (`kernels/kv_fp8.py`)."""
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                     head_dim: int, q_norm_weight: torch.Tensor | None = None,
                     k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, kv_store: KVStore | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (when weights are given) then RoPE, on flattened [T, heads*D] q and k; returns new tensors.
    With `kv_store`, the new k and v also go into the KV cache (`store_kv_ref`)."""
    q_out, k_out = _qk_norm_rope_ref(q, k, positions, cos_sin, head_dim, q_norm_weight, k_norm_weight, eps)
    if kv_store is not None:
        tokens, kv_heads = k_out.shape[0], k_out.shape[-1] // head_dim
        store_kv_ref(k_out.view(tokens, kv_heads, head_dim), kv_store.v.reshape(tokens, kv_heads, head_dim),
                     kv_store.k_cache, kv_store.v_cache, kv_store.slot_mapping, k_scale=kv_store.k_scale,
                     v_scale=kv_store.v_scale)
    return q_out, k_out


def _qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                      head_dim: int, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = q.shape[0]
    qh = q.reshape(tokens, -1, head_dim)
    kh = k.reshape(tokens, -1, head_dim)
    if q_norm_weight is not None:
        qh = rms_norm_ref(qh, q_norm_weight, eps)
        kh = rms_norm_ref(kh, k_norm_weight, eps)
    table = cos_sin[positions.long()]
    rotary_dim = cos_sin.shape[-1]  # partial rotary (Qwen3.5): only the first rotary_dim dims of each head turn
    half = rotary_dim // 2
    cos = table[:, None, :half].to(q.dtype)
    sin = table[:, None, half:].to(q.dtype)
    # HF concatenates (freqs, freqs) so cos/sin cover the rotated dims; the two halves share angles, hence the repeat.
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    qh = torch.cat([_rotate_full(qh[..., :rotary_dim], cos, sin), qh[..., rotary_dim:]], dim=-1)
    kh = torch.cat([_rotate_full(kh[..., :rotary_dim], cos, sin), kh[..., rotary_dim:]], dim=-1)
    return qh.reshape(tokens, -1), kh.reshape(tokens, -1)


def _rotate_full(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr,
                         v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, HQ, HK, stride_q, stride_k, stride_v,
                         stride_cs, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr,
                         FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see kernels/pdl.py: wait for the previous kernel before touching memory
        small_kernel_prologue()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)   # q heads 0..HQ-1, then k heads HQ..HQ+HK-1
    is_q = heads < HQ
    is_k = (heads >= HQ) & (heads < HQ + HK)
    kh = heads - HQ
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    head_dim = 2 * HALF
    q_mask = is_q[:, None] & d_mask[None, :]
    k_mask = is_k[:, None] & d_mask[None, :]
    q_off = t * stride_q + heads[:, None] * head_dim + d[None, :]
    k_off = t * stride_k + kh[:, None] * head_dim + d[None, :]
    act_ty = q_out_ptr.dtype.element_ty
    # Every load before the first store, the position's first (the cos/sin rows depend on it): the compiler cannot
    # tell the stores from the inputs, so a load after a store would wait for a round trip to memory first.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # Each head row comes from q or from k: two masked loads, merged.
    x1 = tl.where(is_q[:, None], tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32),
                  tl.load(k_ptr + k_off, mask=k_mask, other=0.0).to(tl.float32))
    x2 = tl.where(is_q[:, None], tl.load(q_ptr + q_off + HALF, mask=q_mask, other=0.0).to(tl.float32),
                  tl.load(k_ptr + k_off + HALF, mask=k_mask, other=0.0).to(tl.float32))
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        v_off = t * stride_v + kh[:, None] * head_dim + d[None, :]
        v1 = tl.load(v_ptr + v_off, mask=k_mask)
        v2 = tl.load(v_ptr + v_off + HALF, mask=k_mask)
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d_mask, other=0.0).to(act_ty).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0).to(act_ty).to(tl.float32)[None, :]
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim + eps)
        w1 = tl.where(is_q[:, None], tl.load(qw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :])
        w2 = tl.where(is_q[:, None], tl.load(qw_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :])
        # rms_norm_ref rounding: normalised value to the dtype, times the weight, to the dtype again.
        x1 = (w1 * (x1 * rstd[:, None]).to(act_ty).to(tl.float32)).to(act_ty).to(tl.float32)
        x2 = (w2 * (x2 * rstd[:, None]).to(act_ty).to(tl.float32)).to(act_ty).to(tl.float32)
    # The reference computes x*cos + rotate_half(x)*sin in the activation dtype: every product and the sum round.
    o1 = ((x1 * cos).to(act_ty).to(tl.float32) - (x2 * sin).to(act_ty).to(tl.float32)).to(act_ty)
    o2 = ((x2 * cos).to(act_ty).to(tl.float32) + (x1 * sin).to(act_ty).to(tl.float32)).to(act_ty)
    q_dst = q_out_ptr + t * HQ * head_dim + heads[:, None] * head_dim + d[None, :]
    k_dst = k_out_ptr + t * HK * head_dim + kh[:, None] * head_dim + d[None, :]
    tl.store(q_dst, o1, mask=q_mask)
    tl.store(q_dst + HALF, o2, mask=q_mask)
    tl.store(k_dst, o1, mask=k_mask)
    tl.store(k_dst + HALF, o2, mask=k_mask)
    if STORE:   # the KV cache too (saves the separate store_kv launch per layer in decode)
        c_mask = k_mask & (slot >= 0)
        c_off = slot * HK * head_dim + kh[:, None] * head_dim + d[None, :]
        if FP8:  # per-head scales (kernels/kv_fp8.py); o1/o2 are the k_out values, in the activation dtype
            k_s = tl.load(ks_ptr + kh, mask=is_k, other=1.0)[:, None]
            v_s = tl.load(vs_ptr + kh, mask=is_k, other=1.0)[:, None]
            tl.store(kc_ptr + c_off, quantize_to_cache(o1, k_s), mask=c_mask)
            tl.store(kc_ptr + c_off + HALF, quantize_to_cache(o2, k_s), mask=c_mask)
            tl.store(vc_ptr + c_off, quantize_to_cache(v1, v_s), mask=c_mask)
            tl.store(vc_ptr + c_off + HALF, quantize_to_cache(v2, v_s), mask=c_mask)
        else:
            tl.store(kc_ptr + c_off, o1.to(kc_ptr.dtype.element_ty), mask=c_mask)
            tl.store(kc_ptr + c_off + HALF, o2.to(kc_ptr.dtype.element_ty), mask=c_mask)
            tl.store(vc_ptr + c_off, v1.to(vc_ptr.dtype.element_ty), mask=c_mask)
            tl.store(vc_ptr + c_off + HALF, v2.to(vc_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _qk_norm_partial_rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr,
                                 v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, HQ, HK, stride_q, stride_k, stride_v,
                                 stride_cs, eps, D: tl.constexpr, ROT_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                                 STORE: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr,
                                 BLOCK_D: tl.constexpr):
    """Partial rotary (Qwen3.5): dims d < 2*ROT_HALF of each head turn in pairs (d, d + ROT_HALF), the rest pass
    through (normed). Each program loads its heads' rows twice, at d and at d's partner, rather than splitting them
    in halves as the full-rotary kernel does."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)   # q heads 0..HQ-1, then k heads HQ..HQ+HK-1
    is_q = heads < HQ
    is_k = (heads >= HQ) & (heads < HQ + HK)
    kh = heads - HQ
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    rotated = d < 2 * ROT_HALF
    first = d < ROT_HALF
    partner = tl.where(rotated, tl.where(first, d + ROT_HALF, d - ROT_HALF), d)
    freq = tl.where(first, d, d - ROT_HALF)
    q_mask = is_q[:, None] & d_mask[None, :]
    k_mask = is_k[:, None] & d_mask[None, :]
    q_row = q_ptr + t * stride_q + heads[:, None] * D
    k_row = k_ptr + t * stride_k + kh[:, None] * D
    act_ty = q_out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    x = tl.where(is_q[:, None], tl.load(q_row + d[None, :], mask=q_mask, other=0.0).to(tl.float32),
                 tl.load(k_row + d[None, :], mask=k_mask, other=0.0).to(tl.float32))
    xp = tl.where(is_q[:, None], tl.load(q_row + partner[None, :], mask=q_mask, other=0.0).to(tl.float32),
                  tl.load(k_row + partner[None, :], mask=k_mask, other=0.0).to(tl.float32))
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        v = tl.load(v_ptr + t * stride_v + kh[:, None] * D + d[None, :], mask=k_mask)
    cs_mask = rotated & d_mask
    cos = tl.load(cs_ptr + pos * stride_cs + freq, mask=cs_mask, other=1.0).to(act_ty).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + ROT_HALF + freq, mask=cs_mask, other=0.0)
    sin = tl.where(first, -sin, sin).to(act_ty).to(tl.float32)[None, :]  # rotate_half: (-x2, x1)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.where(is_q[:, None], tl.load(qw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                     tl.load(kw_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :])
        wp = tl.where(is_q[:, None], tl.load(qw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :])
        # rms_norm_ref rounding: normalised value to the dtype, times the weight, to the dtype again.
        x = (w * (x * rstd[:, None]).to(act_ty).to(tl.float32)).to(act_ty).to(tl.float32)
        xp = (wp * (xp * rstd[:, None]).to(act_ty).to(tl.float32)).to(act_ty).to(tl.float32)
    # As the reference: x*cos + rotate_half(x)*sin in the activation dtype (each product and the sum round); the
    # dims past the rotary ones keep x (cos 1, sin 0 there).
    o = ((x * cos).to(act_ty).to(tl.float32) + (xp * sin).to(act_ty).to(tl.float32)).to(act_ty)
    tl.store(q_out_ptr + t * HQ * D + heads[:, None] * D + d[None, :], o, mask=q_mask)
    tl.store(k_out_ptr + t * HK * D + kh[:, None] * D + d[None, :], o, mask=k_mask)
    if STORE:
        c_mask = k_mask & (slot >= 0)
        c_off = slot * HK * D + kh[:, None] * D + d[None, :]
        if FP8:  # per-head scales (kernels/kv_fp8.py)
            k_s = tl.load(ks_ptr + kh, mask=is_k, other=1.0)[:, None]
            v_s = tl.load(vs_ptr + kh, mask=is_k, other=1.0)[:, None]
            tl.store(kc_ptr + c_off, quantize_to_cache(o, k_s), mask=c_mask)
            tl.store(vc_ptr + c_off, quantize_to_cache(v, v_s), mask=c_mask)
        else:
            tl.store(kc_ptr + c_off, o.to(kc_ptr.dtype.element_ty), mask=c_mask)
            tl.store(vc_ptr + c_off, v.to(vc_ptr.dtype.element_ty), mask=c_mask)


# Heads per program. Decode's one token is a few short dependent steps (loads, the head's norm, the rotation,
# stores), so more programs with less work each finish sooner: the batch-1 AWQ step replays in 1.714-1.720 ms with 4
# heads (10 programs for Qwen3-8B's 40 q and k heads) against 1.726-1.730 with 32 (2 programs); 8 heads at 8 warps
# and 1 head at 1 warp come close (1.715-1.716), 2 per-thread elements per half-head row being the common shape
# (H200; docs/performance.md).
MAX_HEADS_PER_PROGRAM = 4


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 head_dim: int, q_norm_weight: torch.Tensor | None = None,
                 k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, kv_store: KVStore | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-head RMSNorm (optional) + RoPE with `qk_norm_rope_ref`'s signature and rounding; with `kv_store`,
    the program that writes a k head also writes it and the matching v head into the KV cache.

    q [T, Hq*D], k [T, Hk*D] (row strides free: they may be column slices of the packed qkv output; unit last
    stride), positions [T] int, cos_sin [max_pos, D] fp32 -> new contiguous q_out [T, Hq*D], k_out [T, Hk*D].
    Kernel: grid (T, cdiv(Hq+Hk, BLOCK_H)); a program takes BLOCK_H heads (q and k heads in one index space) of
    one token as two [BLOCK_H, D/2] halves, norms each head in fp32, rotates, stores. Traffic: read + write
    (Hq+Hk)*D elements per token, plus D cos/sin values.
    """
    check_device(q)
    tokens = q.shape[0]
    if head_dim % 2 or q.shape[-1] % head_dim or k.shape[-1] % head_dim or k.shape[0] != tokens:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)}, k {tuple(k.shape)}, head_dim {head_dim} do not match")
    if q.dtype != k.dtype or (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("qk_norm_rope: q and k must share a dtype, and both norm weights be given or neither")
    rotary_dim = cos_sin.shape[-1]
    if rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"cos_sin has {rotary_dim} columns: an even count up to head_dim {head_dim} (partial rotary "
                         "below it)")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    hq, hk = q.shape[-1] // head_dim, k.shape[-1] // head_dim
    q_out = torch.empty(tokens, hq * head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, hk * head_dim, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    has_norm = q_norm_weight is not None
    qw = q_norm_weight.contiguous() if has_norm else q_out
    kw = k_norm_weight.contiguous() if has_norm else k_out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(hq + hk), 2048 // block_half, MAX_HEADS_PER_PROGRAM))
    store = kv_store is not None
    v = kv_store.v if store else q
    if store:
        if tuple(v.shape) != (tokens, hk * head_dim):
            raise ValueError(f"qk_norm_rope kv_store: v {tuple(v.shape)} does not match k {tuple(k.shape)}")
        check_kv_target("qk_norm_rope kv_store", kv_store.k_cache, kv_store.v_cache, kv_store.slot_mapping, tokens,
                        hk, head_dim)
        v = v if v.stride(-1) == 1 else v.contiguous()
    fp8 = store and check_kv_scales("qk_norm_rope kv_store", kv_store.k_cache, kv_store.k_scale, kv_store.v_scale)
    caches = (kv_store.k_cache, kv_store.v_cache, kv_store.slot_mapping) if store else (q_out, q_out, positions)
    caches += (kv_store.k_scale, kv_store.v_scale) if fp8 else (q_out, q_out)
    if rotary_dim < head_dim:
        block_d = triton.next_power_of_2(head_dim)
        block_h = max(1, min(triton.next_power_of_2(hq + hk), 2048 // block_d, MAX_HEADS_PER_PROGRAM))
        _qk_norm_partial_rope_kernel[(tokens, triton.cdiv(hq + hk, block_h))](
            q, k, positions, cos_sin, qw, kw, q_out, k_out, v, *caches, hq, hk, q.stride(0), k.stride(0), v.stride(0),
            cos_sin.stride(0), eps, D=head_dim, ROT_HALF=rotary_dim // 2, HAS_NORM=has_norm, STORE=store, FP8=fp8,
            BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
        return q_out, k_out
    _qk_norm_rope_kernel[(tokens, triton.cdiv(hq + hk, block_h))](
        q, k, positions, cos_sin, qw, kw, q_out, k_out, v, *caches, hq, hk, q.stride(0), k.stride(0), v.stride(0),
        cos_sin.stride(0), eps, HALF=half, HAS_NORM=has_norm, STORE=store, FP8=fp8, BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=4, PDL=use_pdl(q), launch_pdl=use_pdl(q))
    return q_out, k_out
