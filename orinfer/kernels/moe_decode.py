"""MoE decode path: the routed experts as GEMVs over the pairs as routed, for a handful of tokens (T <= 16).

Math (`fused_moe_ref`): h[t*k + j] = silu(x[t] Wg_e^T) * (x[t] Wu_e^T) for e = ids[t, j]; y = h[t*k + j] Wd_e^T;
out[t] = sum_j weights[t, j] * y in fp32, rounded once to x's dtype (h and y rounded as in the reference).

Two launches, no sorting, no host sync, shapes fixed by T, k, E, H, I (CUDA-graph capturable):
  * `_decode_up_kernel`, grid (T*k, cdiv(I, BLOCK_N)): program (p, n) runs expert e = ids[p] if p is e's first
    pair (else it returns at once), for all tokens that chose e: BLOCK_N gate rows and the matching up rows of w13[e]
    against those tokens' x, SwiGLU in the epilogue, h [T*k, I] stored at each token's pair row. Each selected
    expert's gate/up weights are read once per step, spread over I / BLOCK_N programs.
  * `_decode_down_kernel`, grid (cdiv(H, BLOCK_N), SPLIT): program (n, s) walks pairs s*C .. s*C + C - 1 (C =
    cdiv(T*k, SPLIT)); for each that leads its expert, BLOCK_N rows of w2[e] against the h rows of the expert's
    tokens, y rounded to x's dtype, times the routing weights, summed in fp32 registers (pairs in order:
    deterministic). SPLIT == 1 stores out directly; else fp32 partial sums [SPLIT, T, H] and the `moe_sum` kernel
    adds them in split order.
Inner loops (block_m of the config): 1 (T == 1): FMA on the CUDA cores, a [BLOCK_N, BLOCK_K] fp32 register tile and one
reduction at the end (few rows per program, long K tiles: many programs, bandwidth-bound); 16: the expert's weight
tile times the tokens' x^T [BLOCK_K, 16] on the tensor cores (swap-AB: the weight rows are the MMA's M side).
A token's k ids must be distinct (top-k's are): a token is matched to an expert once. An id outside 0..E-1 (also
against the contract) leads no expert and reads no weights: its pair contributes nothing, and memory stays safe
whatever the ids hold (a CUDA graph's padding rows route garbage; kernels/moe_route.py keeps its ids valid anyway).

Traffic per step: the distinct selected experts' 3*I*H weights once (Qwen3-30B-A3B at batch 1, bf16: 8 experts x
9.4 MB = 75.5 MB per layer, 18 us at 4.1 TB/s), plus T*(H + 2*k*I + H) activations and SPLIT*T*H*4 partials.

FP8 experts (`kernels/moe_fp8.py`): the same loops over e4m3 bytes with fp32 block scales s [E, rows, cols]; BLOCK_K
divides bk, so a K step applies one scale per weight row n to its partial sums (the weights are not rounded to x's
dtype, unlike the reference and the grouped path: the fp32 sum of q * s * x up to order):

    acc[n, t] += s[e, row(n), k0 / bk] * sum_{k in step} q[n, k] x[t, k]

(row(n) = n // bn; up rows ceil(I / bn) + n // bn). The FMA loop converts each weight to fp32 (one more multiply per
weight for its scale); the dots unpack the tile in registers as the dense W8A16 kernel does (`fp8_mm._w_operand`:
bf16 x takes the exact e4m3 -> bf16 bit move with x scaled by 2^64 and s by 2^56, fp16 x a convert, fp32 x and the
interpreter exact fp32 dots). Half the bytes: 8 experts of Qwen3-30B-A3B-FP8 at batch 1 are 37.7 MB per layer (+ 0.3
MB of scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.moe_config import MoeConfig, Tile
from orinfer.kernels.fp8_mm import _UNDO, _w_operand, _x_operand
from orinfer.kernels.moe_gemm import _mma, _swiglu, dot_f32, fp8_mode, moe_sum, scale_args
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl


@triton.jit
def _leads(ids_ptr, p, e, E, BLOCK_P: tl.constexpr):
    """Whether pair p is the first pair that chose expert e (the program that runs e for all its tokens); never for
    an id outside 0..E-1, which would index the weights out of bounds (it selects no expert)."""
    offs = tl.arange(0, BLOCK_P)
    earlier = tl.load(ids_ptr + offs, mask=offs < p, other=-1)
    return (tl.sum((earlier == e).to(tl.int32), axis=0) == 0) & (e >= 0) & (e < E)


@triton.jit
def _expert_tokens(ids_ptr, e, T, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KS: tl.constexpr):
    """([BLOCK_T] whether token t chose e, [BLOCK_T] its pair row t*k + j where ids[t, j] == e)."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_j = tl.arange(0, BLOCK_KS)
    ids = tl.load(ids_ptr + offs_t[:, None] * TOP_K + offs_j[None, :],
                  mask=(offs_t < T)[:, None] & (offs_j < TOP_K)[None, :], other=-1)
    hit = ids == e
    chose = tl.sum(hit.to(tl.int32), axis=1) > 0
    # The first j with ids[t, j] == e (the only one: a token's ids are distinct); a minimum, not a sum, so that
    # repeated ids (against the contract) still name one of the token's own k rows, never a row past them.
    first = tl.minimum(tl.min(tl.where(hit, offs_j[None, :], BLOCK_KS), axis=1), TOP_K - 1)
    return chose, offs_t * TOP_K + first


@triton.jit
def _mma_fp8(q, x, s, acc, MODE: tl.constexpr):
    """acc + (q @ x) * s[:, None] in fp32: q [BLOCK_N, BLOCK_K] an e4m3 weight tile inside one scale column (swap-AB:
    the weight rows are the MMA's M side), x [BLOCK_K, BLOCK_T] activations, s [BLOCK_N] the rows' scales. MODE as
    `fp8_mm` (PLAIN: exact fp32 dots; A16_BF16: products come out times 2^-56, which s takes back)."""
    if MODE == 2:
        part = tl.dot(q.to(tl.float32), x.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(_w_operand(q, MODE), _x_operand(x, MODE))
    if MODE == 0:
        s = s * _UNDO
    return acc + part * s[:, None]


@triton.jit
def _scaled_step(acc, w, a, s_ptrs, k0, USE_DOT: tl.constexpr, FP8: tl.constexpr, MODE: tl.constexpr,
                 DOT_F32: tl.constexpr, BK: tl.constexpr):
    """acc + one K step of the weight tile w [BLOCK_N, BLOCK_K] against a (x^T [BLOCK_K, BLOCK_T] for dots, x
    [1, BLOCK_K] for the FMA loop); FP8: times the scales of the step's column, s_ptrs [BLOCK_N] at column 0."""
    if FP8:
        s = tl.load(s_ptrs + k0 // BK)
        if USE_DOT:
            return _mma_fp8(w, a, s, acc, MODE)
        else:
            return acc + w.to(tl.float32) * a.to(tl.float32) * s[:, None]
    else:
        if USE_DOT:
            return _mma(w, a, acc, DOT_F32)
        else:
            return acc + w.to(tl.float32) * a.to(tl.float32)


@triton.jit
def _expert_dot(a_ptr, rows, ok, stride_a, w_ptrs, up_off, s_ptrs, s_up_off, K, GATED: tl.constexpr,
                USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr, MODE: tl.constexpr,
                BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                EVEN_K: tl.constexpr):
    """(g, u) [BLOCK_N, BLOCK_T] fp32: the weight rows at w_ptrs ([BLOCK_N, BLOCK_K] pointers at k = 0; the up rows
    up_off further when GATED) times activation rows `rows` of a (zero where not `ok`), summed over K. FP8: s_ptrs
    [BLOCK_N] point at the rows' scales of column 0 (the up rows' s_up_off further)."""
    offs_k = tl.arange(0, BLOCK_K)
    if USE_DOT:                                                  # x^T [BLOCK_K, BLOCK_T]
        a_ptrs = a_ptr + rows.to(tl.int64)[None, :] * stride_a + offs_k[:, None]
        a_ok = ok[None, :]
        acc_g = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    else:                                                        # x [1, BLOCK_K]
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
        a_ok = ok[:, None]
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    for k0 in range(0, K, BLOCK_K):
        # Weights are streamed once: evict_first keeps them from pushing the activations out of L2.
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok, other=0.0)
            wg = tl.load(w_ptrs, eviction_policy="evict_first")
            if GATED:
                wu = tl.load(w_ptrs + up_off, eviction_policy="evict_first")
        else:
            k_in = (k0 + offs_k) < K
            if USE_DOT:
                a = tl.load(a_ptrs, mask=a_ok & k_in[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=a_ok & k_in[None, :], other=0.0)
            wg = tl.load(w_ptrs, mask=k_in[None, :], other=0.0, eviction_policy="evict_first")
            if GATED:
                wu = tl.load(w_ptrs + up_off, mask=k_in[None, :], other=0.0, eviction_policy="evict_first")
        acc_g = _scaled_step(acc_g, wg, a, s_ptrs, k0, USE_DOT, FP8, MODE, DOT_F32, BK)
        if GATED:
            acc_u = _scaled_step(acc_u, wu, a, s_ptrs + s_up_off, k0, USE_DOT, FP8, MODE, DOT_F32, BK)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if USE_DOT:
        return acc_g, acc_u
    else:
        return tl.sum(acc_g, axis=1)[:, None], tl.sum(acc_u, axis=1)[:, None]


@triton.jit
def _decode_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, ids_ptr, T, E, I, H, stride_xt, stride_we, stride_wn, stride_se,
                      stride_sn, UP_SROW, stride_hm, TOP_K: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_KS: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                      FP8: tl.constexpr, MODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p)
    if _leads(ids_ptr, p, e, E, BLOCK_P):
        chose, pair_rows = _expert_tokens(ids_ptr, e, T, TOP_K, BLOCK_T, BLOCK_KS)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = tl.minimum(offs_n, I - 1).to(tl.int64)              # rows past I re-read the last (not stored)
        w_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
        s_ptrs = s_ptr + e.to(tl.int64) * stride_se + (rn // BN) * stride_sn
        g, u = _expert_dot(x_ptr, tl.arange(0, BLOCK_T), chose, stride_xt, w_ptrs, I * stride_wn, s_ptrs,
                           UP_SROW * stride_sn, H, True, USE_DOT, DOT_F32, FP8, MODE, BK, BLOCK_N, BLOCK_K, BLOCK_T,
                           EVEN_K)
        if PDL:
            gdc_launch_dependents()
        h = _swiglu(g, u, h_ptr.dtype.element_ty)
        dst = h_ptr + pair_rows.to(tl.int64)[None, :] * stride_hm + offs_n[:, None]
        tl.store(dst, h, mask=chose[None, :] & (offs_n < I)[:, None])


@triton.jit
def _decode_down_kernel(h_ptr, w_ptr, s_ptr, wts_ptr, ids_ptr, out_ptr, T, E, H, I, stride_hm, stride_we, stride_wn,
                        stride_se, stride_sn, UP_SROW, stride_om, PAIRS_PER_SPLIT, TOP_K: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KS: tl.constexpr, USE_DOT: tl.constexpr,
                        DOT_F32: tl.constexpr, FP8: tl.constexpr, MODE: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        PARTIAL: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, H - 1).to(tl.int64)
    s = tl.program_id(1)
    act_ty = h_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for p in range(s * PAIRS_PER_SPLIT, tl.minimum(s * PAIRS_PER_SPLIT + PAIRS_PER_SPLIT, T * TOP_K)):
        e = tl.load(ids_ptr + p)
        if _leads(ids_ptr, p, e, E, BLOCK_P):
            chose, pair_rows = _expert_tokens(ids_ptr, e, T, TOP_K, BLOCK_T, BLOCK_KS)
            w_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
            s_ptrs = s_ptr + e.to(tl.int64) * stride_se + (rn // BN) * stride_sn
            y, _ = _expert_dot(h_ptr, pair_rows, chose, stride_hm, w_ptrs, 0, s_ptrs, 0, I, False, USE_DOT, DOT_F32,
                               FP8, MODE, BK, BLOCK_N, BLOCK_K, BLOCK_T, EVEN_K)
            wt = tl.load(wts_ptr + pair_rows, mask=chose, other=0.0)
            acc += y.to(act_ty).to(tl.float32) * wt[None, :]
    if PDL:
        gdc_launch_dependents()
    offs_t = tl.arange(0, BLOCK_T)
    mask = (offs_t < T)[None, :] & (offs_n < H)[:, None]
    if PARTIAL:                                                  # split: fp32 partial sums [SPLIT, T, H]
        tl.store(out_ptr + (s * T + offs_t)[None, :] * stride_om + offs_n[:, None], acc, mask=mask)
    else:
        tl.store(out_ptr + offs_t[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _meta(tokens: int, top_k: int, block_m: int, tile: Tile, k: int, x: torch.Tensor, w: torch.Tensor) -> dict:
    pdl = use_pdl(x)
    return dict(TOP_K=top_k, BLOCK_P=triton.next_power_of_2(tokens * top_k), BLOCK_T=max(block_m, 1),
                BLOCK_KS=triton.next_power_of_2(top_k), USE_DOT=block_m > 1, DOT_F32=dot_f32(x, w), MODE=fp8_mode(x),
                BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=k % tile.block_k == 0, PDL=pdl,
                num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl)


def decode_up(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, block_m: int, tile: Tile,
              scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """h [T*k, I] in x's dtype: row t*k + j = SwiGLU of token t through expert ids[t, j]. `scale`, `block_size`:
    w13 is FP8 with these block scales."""
    tokens, top_k = topk_ids.shape
    hidden, inter = x.shape[1], w13.shape[1] // 2
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _decode_up_kernel[(tokens * top_k, triton.cdiv(inter, tile.block_n))](
        x_ptr=x, w_ptr=w13, h_ptr=h, ids_ptr=topk_ids, T=tokens, E=w13.shape[0], I=inter, H=hidden,
        stride_xt=x.stride(0), stride_we=w13.stride(0), stride_wn=w13.stride(1), stride_hm=h.stride(0),
        **scale_args(w13, scale, block_size, True), **_meta(tokens, top_k, block_m, tile, hidden, x, w13))
    return h


def decode_down(h: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, block_m: int,
                tile: Tile, split: int, scale: torch.Tensor | None = None,
                block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """out [T, H] in h's dtype: sum_j weights[t, j] * (h[t*k + j] Wd_{ids[t, j]}^T), y rounded per pair."""
    tokens, top_k = topk_ids.shape
    hidden, inter = w2.shape[1], w2.shape[2]
    split = max(1, min(split, tokens * top_k))
    per_split = triton.cdiv(tokens * top_k, split)
    split = triton.cdiv(tokens * top_k, per_split)               # no empty split
    if split == 1:
        out = torch.empty(tokens, hidden, dtype=h.dtype, device=h.device)
    else:
        out = torch.empty(split * tokens, hidden, dtype=torch.float32, device=h.device)
    _decode_down_kernel[(triton.cdiv(hidden, tile.block_n), split)](
        h_ptr=h, w_ptr=w2, wts_ptr=topk_weights, ids_ptr=topk_ids, out_ptr=out, T=tokens, E=w2.shape[0], H=hidden,
        I=inter, stride_hm=h.stride(0), stride_we=w2.stride(0), stride_wn=w2.stride(1), stride_om=out.stride(0),
        PAIRS_PER_SPLIT=per_split, PARTIAL=split > 1, **scale_args(w2, scale, block_size, False),
        **_meta(tokens, top_k, block_m, tile, inter, h, w2))
    return out if split == 1 else moe_sum(out, None, tokens, split, 1, tokens, h.dtype)


def fused_moe_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, cfg: MoeConfig, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                     block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """The decode path of `fused_moe` (inputs checked by the caller; T == 1 for block_m 1, T <= 16 for 16).
    `scales` (s13, s2) with `block_size`: FP8 experts (block_k dividing bk: `moe_fp8.fp8_config`)."""
    s13, s2 = scales if scales is not None else (None, None)
    h = decode_up(x, w13, topk_ids, cfg.block_m, cfg.up, s13, block_size)
    return decode_down(h, w2, topk_weights, topk_ids, cfg.block_m, cfg.down, cfg.split, s2, block_size)
