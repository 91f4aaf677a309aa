"""Triton expert kernels over 4-bit (W4) experts (`kernels/moe_w4.py`: AWQ / GPTQ-Int4 MoE): the grouped GEMMs for
prefill-sized batches and the decode path for a few tokens, with the contracts and launch structure of the 16-bit /
FP8 kernels (`moe_gemm.py`, `moe_decode.py`, whose routing helpers, SwiGLU epilogue and combine they reuse).

A K step is one W4 chunk: 8R inputs held by R int32 per weight row (R = min(G, 128) / 8), inside one group, so the
step reads one zero point z and one scale s per row. `_codes` unpacks a row-major [rows, R] word tile into the
[rows, 8R] codes in input order (nibble p of word r is input p*R + r: eight shifts and a reshape).

Grouped (`_w4_grouped_kernel`, grid and ordering as `moe_gemm._grouped_kernel`): per K step a program loads its
[BLOCK_M, 8R] rows of x (gathered by pair for gate/up) and the expert's [BLOCK_N, R] words (two tiles, gate and up,
when GATED), dequantises each weight tile in registers to x's dtype, W = (q - z) * s rounded once (the reference's
weights), and accumulates tl.dot in fp32. Padding rows and the sum as in moe_gemm. Weight traffic: ceil(rows_e /
BLOCK_M) * 3*I*H * (0.5 + 3/G) bytes per used expert (a quarter of bf16's), shared within a band through L2.

Decode (`_w4_decode_up_kernel`, `_w4_decode_down_kernel`, grid and leader rule as `moe_decode`): each selected
expert's words are read once per step. Per chunk the exact codes q - z (small integers, exact in any dtype) meet x,
and the row's scale multiplies the chunk's partial sums in fp32:

    acc[n, t] += s[e, n, g] * sum_{k in chunk} (q[e, n, k] - z[e, n, g]) x[t, k]

(block_m 1: an FMA loop on the CUDA cores over a [BLOCK_N, 8R] fp32 tile; 16: a tensor-core dot of the codes, swap-AB,
against x^T [8R, 16]). No weight is rounded to x's dtype, so this path is slightly closer to the exact fp32 result
than the reference (as the FP8 decode path is). Traffic: the distinct selected experts' 3*I*H*(0.5 + 3/G) bytes once
(Qwen3-30B-A3B at batch 1, G = 128: 8 x 2.46 MB = 19.7 MB per layer) + activations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.moe_align import moe_align
from orinfer.kernels.moe_config import MoeConfig, Tile
from orinfer.kernels.moe_decode import _expert_tokens, _leads
from orinfer.kernels.moe_gemm import GROUP_M, _mma, _swiglu, band_tile, dot_f32, grouped_rows, moe_sum
from orinfer.kernels.moe_w4 import W4Experts
from orinfer.kernels.w4_mma import _chunk_dot, _group_zero_scale, _x_slices
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl


@triton.jit
def _codes(words, ROWS: tl.constexpr, R: tl.constexpr):
    """[ROWS, R] int32 words of one chunk -> [ROWS, 8R] int32 codes 0..15 in input order (k = p*R + r)."""
    p = tl.arange(0, 8)
    nibbles = (words[:, None, :] >> (4 * p)[None, :, None]) & 15             # [ROWS, 8, R]
    return tl.reshape(nibbles, (ROWS, 8 * R))


@triton.jit
def _w4_weight_tile(q_ptrs, z_ptrs, s_ptrs, act_ty: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr):
    """The [8R, BLOCK_N] weight tile (K-major, a dot's second operand) of one chunk: (q - z) * s rounded to act_ty.
    q_ptrs [BLOCK_N, R] point at the chunk's words, z_ptrs / s_ptrs [BLOCK_N] at the rows' zero points and scales."""
    q = _codes(tl.load(q_ptrs), BLOCK_N, R).to(tl.float32)
    z = tl.load(z_ptrs).to(tl.float32)
    s = tl.load(s_ptrs).to(tl.float32)
    return tl.trans(((q - z[:, None]) * s[:, None]).to(act_ty))


@triton.jit
def _dequant_slices_dot(acc, xs, q_ptrs, z_ptrs, s_ptrs, act_ty: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + one chunk (R >= 16): xs the chunk's eight [BLOCK_M, R] slices of x (inputs p*R ..),
    q_ptrs [BLOCK_N, R] the rows' words, whose nibble p is the weight of slice p; each slice is dequantised in
    registers to act_ty, (q - z) * s rounded once, and meets its x slice in a K = R dot."""
    words = tl.load(q_ptrs)
    z = tl.load(z_ptrs).to(tl.float32)[:, None]
    s = tl.load(s_ptrs).to(tl.float32)[:, None]
    for p in tl.static_range(8):
        w = ((((words >> (4 * p)) & 15).to(tl.float32) - z) * s).to(act_ty)
        acc = _mma(xs[p], tl.trans(w), acc, DOT_F32)
    return acc


@triton.jit
def _w4_grouped_kernel(a_ptr, q_ptr, s_ptr, z_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_blocks, A_ROWS, N_OUT,
                       K8, N_PAIRS, stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
                       TOP_K: tl.constexpr, GATED: tl.constexpr, DOT_F32: tl.constexpr, G8: tl.constexpr,
                       R: tl.constexpr, SLICED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       GROUP_M: tl.constexpr):
    pid_m, pid_n, expert = band_tile(block_expert_ptr, num_blocks, N_OUT, BLOCK_N, GROUP_M)
    if expert >= 0:
        offs_m, pairs, rows, offs_n, rn = grouped_rows(sorted_ptr, pid_m, pid_n, A_ROWS, N_OUT, TOP_K, GATED, BLOCK_M,
                                                       BLOCK_N)
        if SLICED:                                               # the chunk as eight [BLOCK_M, R] slices
            a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + tl.arange(0, R)[None, :]
        else:                                                    # the chunk as one [BLOCK_M, 8R] tile
            a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + tl.arange(0, 8 * R)[None, :]
        qg_ptrs = q_ptr + expert.to(tl.int64) * stride_qe + rn[:, None] * stride_qn + tl.arange(0, R)[None, :]
        qu_ptrs = qg_ptrs + N_OUT * stride_qn
        sg = expert.to(tl.int64) * stride_se + rn * stride_sn     # [BLOCK_N] rows' first group (scales and zeros)
        su = sg + N_OUT * stride_sn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        act_ty = out_ptr.dtype.element_ty
        for c in range(0, K8, R):                                # one chunk of 8R inputs per step
            grp = c // G8
            if SLICED:
                xs = _x_slices(a_ptrs, R, False)
                acc_g = _dequant_slices_dot(acc_g, xs, qg_ptrs + c, z_ptr + sg + grp, s_ptr + sg + grp, act_ty,
                                            DOT_F32)
                if GATED:
                    acc_u = _dequant_slices_dot(acc_u, xs, qu_ptrs + c, z_ptr + su + grp, s_ptr + su + grp, act_ty,
                                                DOT_F32)
            else:
                a = tl.load(a_ptrs)
                wg = _w4_weight_tile(qg_ptrs + c, z_ptr + sg + grp, s_ptr + sg + grp, act_ty, BLOCK_N, R)
                acc_g = _mma(a, wg, acc_g, DOT_F32)
                if GATED:
                    wu = _w4_weight_tile(qu_ptrs + c, z_ptr + su + grp, s_ptr + su + grp, act_ty, BLOCK_N, R)
                    acc_u = _mma(a, wu, acc_u, DOT_F32)
            a_ptrs += 8 * R
        n_ok = (offs_n < N_OUT)[None, :]
        if GATED:
            dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(dst, _swiglu(acc_g, acc_u, act_ty), mask=n_ok)
        else:
            dst = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(dst, acc_g.to(act_ty), mask=(pairs < N_PAIRS)[:, None] & n_ok)


def _launch_grouped(a: torch.Tensor, w: W4Experts, out: torch.Tensor, align, n_out: int, a_rows: int, n_pairs: int,
                    top_k: int, gated: bool, tile: Tile) -> torch.Tensor:
    num_blocks = align.block_expert.numel()
    grid = (num_blocks * triton.cdiv(n_out, tile.block_n),)
    _w4_grouped_kernel[grid](
        a, w.packed, w.scales, w.zeros, out, align.sorted_pairs, align.block_expert, num_blocks, a_rows, n_out,
        a.shape[1] // 8, n_pairs, a.stride(0), w.packed.stride(0), w.packed.stride(1), w.scales.stride(0),
        w.scales.stride(1), out.stride(0), TOP_K=top_k, GATED=gated, DOT_F32=dot_f32(a, a), G8=w.group_size // 8,
        R=tile.block_k // 8, SLICED=tile.block_k >= 128, BLOCK_M=align.block_m, BLOCK_N=tile.block_n,
        GROUP_M=GROUP_M, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    return out


def fused_moe_w4_grouped(x: torch.Tensor, w13: W4Experts, w2: W4Experts, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
    """The grouped path (inputs checked by the caller; the config's block_k is the W4 chunk, `moe_w4.w4_config`):
    align, gate/up + SwiGLU, down, the weighted sum. Five launches."""
    tokens, top_k = topk_ids.shape
    inter = w2.in_features
    align = moe_align(topk_ids, w13.num_experts, cfg.block_m)
    h = torch.empty(align.sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    _launch_grouped(x, w13, h, align, inter, tokens, tokens * top_k, top_k, True, cfg.up)
    y = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    _launch_grouped(h, w2, y, align, x.shape[1], h.shape[0], tokens * top_k, 1, False, cfg.down)
    return moe_sum(y, topk_weights, tokens, top_k, top_k, 1, x.dtype)


# --- decode ---------------------------------------------------------------------------------------------------------

@triton.jit
def _masked_slices(a_ptrs, a_ok, R: tl.constexpr, F32: tl.constexpr):
    """The chunk's x as eight slices (inputs p*R .., p = 0..7) at a_ptrs, zero where not a_ok; F32: widened to fp32
    (the exact dots of fp32 x and the interpreter)."""
    xs = (tl.load(a_ptrs, mask=a_ok, other=0.0), tl.load(a_ptrs + R, mask=a_ok, other=0.0),
          tl.load(a_ptrs + 2 * R, mask=a_ok, other=0.0), tl.load(a_ptrs + 3 * R, mask=a_ok, other=0.0),
          tl.load(a_ptrs + 4 * R, mask=a_ok, other=0.0), tl.load(a_ptrs + 5 * R, mask=a_ok, other=0.0),
          tl.load(a_ptrs + 6 * R, mask=a_ok, other=0.0), tl.load(a_ptrs + 7 * R, mask=a_ok, other=0.0))
    if F32:
        xs = (xs[0].to(tl.float32), xs[1].to(tl.float32), xs[2].to(tl.float32), xs[3].to(tl.float32),
              xs[4].to(tl.float32), xs[5].to(tl.float32), xs[6].to(tl.float32), xs[7].to(tl.float32))
    return xs


@triton.jit
def _fma_slices(acc, xs, q_ptrs, zs):
    """acc [BLOCK_N, R] + s * sum_p (q_p - z) * x_p in fp32 for one chunk (the one-token FMA loop): q_p nibble p of the
    rows' words [BLOCK_N, R], x_p [1, R] slice p, zs = (z, s) [BLOCK_N]."""
    words = tl.load(q_ptrs, eviction_policy="evict_first")
    z = zs[0].to(tl.float32)[:, None]
    part = (((words & 15).to(tl.float32) - z) * xs[0].to(tl.float32))
    for p in tl.static_range(1, 8):
        part += (((words >> (4 * p)) & 15).to(tl.float32) - z) * xs[p].to(tl.float32)
    return acc + part * zs[1][:, None]


@triton.jit
def _w4_step(acc, q_ptrs, z_ptrs, s_ptrs, a, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
             R: tl.constexpr):
    """acc + s * ((q - z) . a) for one chunk of R < 16 int32 (unpacked as one [BLOCK_N, 8R] tile): q_ptrs [BLOCK_N, R]
    the rows' words, z_ptrs / s_ptrs [BLOCK_N]; a is x^T [8R, BLOCK_T] (dots) or x [1, 8R] (the FMA loop, whose acc
    [BLOCK_N, 8R] is reduced at the end)."""
    codes = _codes(tl.load(q_ptrs, eviction_policy="evict_first"), BLOCK_N, R).to(tl.float32)
    w = codes - tl.load(z_ptrs).to(tl.float32)[:, None]         # exact small integers
    s = tl.load(s_ptrs).to(tl.float32)[:, None]
    if USE_DOT:
        if DOT_F32:
            part = tl.dot(w, a.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(w.to(a.dtype), a)
        return acc + part * s
    else:
        return acc + w * a.to(tl.float32) * s


@triton.jit
def _w4_expert_dot(a_ptr, rows, ok, stride_a, q_ptrs, up_off, sz, s_up_off, s_ptr, z_ptr, K8, GATED: tl.constexpr,
                   USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, FP16: tl.constexpr, G8: tl.constexpr,
                   R: tl.constexpr, SLICED: tl.constexpr, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    """(g, u) [BLOCK_N, BLOCK_T] fp32: the weight rows at q_ptrs ([BLOCK_N, R] words of chunk 0; the up rows up_off
    further when GATED, their scales / zeros s_up_off further than sz [BLOCK_N]) times activation rows `rows` of a
    (zero where not `ok`), summed over all K8 int32 columns. SLICED (R >= 16): the chunk's eight nibble slices as the
    dense W4 kernels take them (`w4_mma._chunk_dot`: exact codes on the tensor cores, the unpack in registers);
    else one unpacked [BLOCK_N, 8R] tile per chunk. WIDTH: the inputs of x a load takes (R sliced, else 8R)."""
    offs_k = tl.arange(0, WIDTH)
    if USE_DOT:                                                  # x^T [WIDTH, BLOCK_T]
        a_ptrs = a_ptr + rows.to(tl.int64)[None, :] * stride_a + offs_k[:, None]
        a_ok = ok[None, :]
        acc_g = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    else:                                                        # x [1, WIDTH]
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
        a_ok = ok[:, None]
        acc_g = tl.zeros([BLOCK_N, WIDTH], dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    for c in range(0, K8, R):
        grp = c // G8
        if SLICED:
            xs = _masked_slices(a_ptrs, a_ok, R, DOT_F32)
            zs_g = _group_zero_scale(z_ptr, s_ptr, sz + grp)
            if USE_DOT:
                acc_g = _chunk_dot(acc_g, xs, q_ptrs + c, zs_g, DOT_F32, FP16)
            else:
                acc_g = _fma_slices(acc_g, xs, q_ptrs + c, zs_g)
            if GATED:
                zs_u = _group_zero_scale(z_ptr, s_ptr, sz + s_up_off + grp)
                if USE_DOT:
                    acc_u = _chunk_dot(acc_u, xs, q_ptrs + up_off + c, zs_u, DOT_F32, FP16)
                else:
                    acc_u = _fma_slices(acc_u, xs, q_ptrs + up_off + c, zs_u)
        else:
            a = tl.load(a_ptrs, mask=a_ok, other=0.0)
            acc_g = _w4_step(acc_g, q_ptrs + c, z_ptr + sz + grp, s_ptr + sz + grp, a, USE_DOT, DOT_F32, BLOCK_N, R)
            if GATED:
                acc_u = _w4_step(acc_u, q_ptrs + up_off + c, z_ptr + sz + s_up_off + grp,
                                 s_ptr + sz + s_up_off + grp, a, USE_DOT, DOT_F32, BLOCK_N, R)
        a_ptrs += 8 * R
    if USE_DOT:
        return acc_g, acc_u
    else:
        return tl.sum(acc_g, axis=1)[:, None], tl.sum(acc_u, axis=1)[:, None]


@triton.jit
def _w4_decode_up_kernel(x_ptr, q_ptr, s_ptr, z_ptr, h_ptr, ids_ptr, T, E, I, H8, stride_xt, stride_qe, stride_qn,
                         stride_se, stride_sn, stride_hm, TOP_K: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_KS: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                         FP16: tl.constexpr, G8: tl.constexpr, R: tl.constexpr, SLICED: tl.constexpr,
                         WIDTH: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Program (p, n): if pair p leads its expert e, SwiGLU of BLOCK_N gate rows (and the matching up rows) of e for
    every token that chose e, stored at the tokens' pair rows of h [T*k, I]."""
    if PDL:
        gdc_wait()
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p)
    if _leads(ids_ptr, p, e, E, BLOCK_P):
        chose, pair_rows = _expert_tokens(ids_ptr, e, T, TOP_K, BLOCK_T, BLOCK_KS)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = tl.minimum(offs_n, I - 1).to(tl.int64)              # rows past I re-read the last (not stored)
        q_ptrs = q_ptr + e.to(tl.int64) * stride_qe + rn[:, None] * stride_qn + tl.arange(0, R)[None, :]
        sz = e.to(tl.int64) * stride_se + rn * stride_sn
        g, u = _w4_expert_dot(x_ptr, tl.arange(0, BLOCK_T), chose, stride_xt, q_ptrs, I * stride_qn, sz,
                              I * stride_sn, s_ptr, z_ptr, H8, True, USE_DOT, DOT_F32, FP16, G8, R, SLICED, WIDTH,
                              BLOCK_N, BLOCK_T)
        if PDL:
            gdc_launch_dependents()
        h = _swiglu(g, u, h_ptr.dtype.element_ty)
        dst = h_ptr + pair_rows.to(tl.int64)[None, :] * stride_hm + offs_n[:, None]
        tl.store(dst, h, mask=chose[None, :] & (offs_n < I)[:, None])


@triton.jit
def _w4_decode_down_kernel(h_ptr, q_ptr, s_ptr, z_ptr, wts_ptr, ids_ptr, out_ptr, T, E, H, I8, stride_hm, stride_qe,
                           stride_qn, stride_se, stride_sn, stride_om, PAIRS_PER_SPLIT, TOP_K: tl.constexpr,
                           BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KS: tl.constexpr,
                           USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, FP16: tl.constexpr, G8: tl.constexpr,
                           R: tl.constexpr, SLICED: tl.constexpr, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr,
                           PARTIAL: tl.constexpr, PDL: tl.constexpr):
    """Program (n, s): BLOCK_N outputs of the pairs s*C .. s*C + C - 1 that lead their experts, y rounded to x's
    dtype, times the routing weights, summed in fp32 (pairs in order); PARTIAL: fp32 partial sums [SPLIT, T, H]."""
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
            q_ptrs = q_ptr + e.to(tl.int64) * stride_qe + rn[:, None] * stride_qn + tl.arange(0, R)[None, :]
            sz = e.to(tl.int64) * stride_se + rn * stride_sn
            y, _ = _w4_expert_dot(h_ptr, pair_rows, chose, stride_hm, q_ptrs, 0, sz, 0, s_ptr, z_ptr, I8, False,
                                  USE_DOT, DOT_F32, FP16, G8, R, SLICED, WIDTH, BLOCK_N, BLOCK_T)
            wt = tl.load(wts_ptr + pair_rows, mask=chose, other=0.0)
            acc += y.to(act_ty).to(tl.float32) * wt[None, :]
    if PDL:
        gdc_launch_dependents()
    offs_t = tl.arange(0, BLOCK_T)
    mask = (offs_t < T)[None, :] & (offs_n < H)[:, None]
    if PARTIAL:
        tl.store(out_ptr + (s * T + offs_t)[None, :] * stride_om + offs_n[:, None], acc, mask=mask)
    else:
        tl.store(out_ptr + offs_t[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _decode_meta(tokens: int, top_k: int, block_m: int, tile: Tile, x: torch.Tensor, w: W4Experts) -> dict:
    pdl = use_pdl(x)
    return dict(TOP_K=top_k, BLOCK_P=triton.next_power_of_2(tokens * top_k), BLOCK_T=max(block_m, 1),
                BLOCK_KS=triton.next_power_of_2(top_k), USE_DOT=block_m > 1, DOT_F32=dot_f32(x, x),
                FP16=x.dtype == torch.float16, G8=w.group_size // 8, R=tile.block_k // 8,
                SLICED=tile.block_k >= 128, WIDTH=tile.block_k // 8 if tile.block_k >= 128 else tile.block_k,
                BLOCK_N=tile.block_n, PDL=pdl, num_warps=tile.num_warps,
                num_stages=tile.num_stages, launch_pdl=pdl)


def fused_moe_w4_decode(x: torch.Tensor, w13: W4Experts, w2: W4Experts, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
    """The decode path (inputs checked by the caller; T == 1 for block_m 1, T <= 16 for 16; block_k the W4 chunk):
    two launches (three with a split), each selected expert's words read once."""
    tokens, top_k = topk_ids.shape
    hidden, inter = x.shape[1], w2.in_features
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _w4_decode_up_kernel[(tokens * top_k, triton.cdiv(inter, cfg.up.block_n))](
        x, w13.packed, w13.scales, w13.zeros, h, topk_ids, tokens, w13.num_experts, inter, hidden // 8, x.stride(0),
        w13.packed.stride(0), w13.packed.stride(1), w13.scales.stride(0), w13.scales.stride(1), h.stride(0),
        **_decode_meta(tokens, top_k, cfg.block_m, cfg.up, x, w13))
    pairs = tokens * top_k
    per_split = triton.cdiv(pairs, max(1, min(cfg.split, pairs)))
    split = triton.cdiv(pairs, per_split)                        # no empty split
    if split == 1:
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split * tokens, hidden, dtype=torch.float32, device=x.device)
    _w4_decode_down_kernel[(triton.cdiv(hidden, cfg.down.block_n), split)](
        h, w2.packed, w2.scales, w2.zeros, topk_weights, topk_ids, out, tokens, w2.num_experts, hidden, inter // 8,
        h.stride(0), w2.packed.stride(0), w2.packed.stride(1), w2.scales.stride(0), w2.scales.stride(1),
        out.stride(0), per_split, PARTIAL=split > 1, **_decode_meta(tokens, top_k, cfg.block_m, cfg.down, h, w2))
    return out if split == 1 else moe_sum(out, None, tokens, split, 1, tokens, x.dtype)
