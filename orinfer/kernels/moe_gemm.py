"""Grouped expert GEMMs over expert-sorted blocks of rows (`fused_moe_ref`'s contract for prefill-sized batches).

With x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], the N = T*k (token, slot) pairs sorted by
expert and padded per expert to BLOCK_M rows (`moe_align`: sorted_pairs [P], block_expert [P/BLOCK_M]):

    up    (GATED): for sorted row r of block b (expert e = block_expert[b], pair p = sorted_pairs[r], token p // k)
          h[r, :] = silu(x[p // k] Wg_e^T) * (x[p // k] Wu_e^T)                          h [P, I], x's dtype
    down:        y[p, :] = h[r, :] Wd_e^T                                                 y [N, H], x's dtype
    sum:         out[t, :] = sum_j weights[t, j] * y[t*k + j, :]   in fp32, rounded once  out [T, H]

Roundings as the reference: g and u to x's dtype, silu, the product; y to x's dtype; the weighted sum in fp32. The
routing weight is applied in the sum, not in the down GEMM's epilogue: y then stays in x's dtype with exactly the
reference's rounding (folding the weight in would need an fp32 y, twice the bytes, or a second rounding), and the k
outputs of a token are added in a fixed order (deterministic, no atomics).

`_grouped_kernel` (both GEMMs): grid (P/BLOCK_M * cdiv(n_out, BLOCK_N),), programs ordered in bands of GROUP_M blocks
so that blocks of one expert share its weight tiles in L2; a block past the last segment (-1) does nothing. A
program gathers its BLOCK_M rows of x (up) or reads its contiguous rows of h (down), runs the K loop of tensor-core
`tl.dot`s (fp32 accumulate) against the expert's [BLOCK_N, BLOCK_K] weight tiles (two, gate and up, when GATED), and
stores its epilogue; padding rows (pair N) read the last token and are never stored by the down GEMM. fp32 and mixed
(fp32 x, 16-bit weights) take exact fp32 dots ("ieee"). Weights are read once per block of their expert:
traffic ~ sum over used experts of ceil(rows_e / BLOCK_M) * 3*I*H*sizeof(w) (L2 shares it within a band) + the
activations: gather of x (P*H), h written and read (2*P*I), y written and read (2*N*H), out (T*H).

FP8 experts (`kernels/moe_fp8.py`, W8A16): w13 / w2 hold e4m3 bytes with fp32 block scales s [E, rows, cols] of
[bn, bk] blocks; BLOCK_K divides bk, so each K step of a tile sees one scale per weight row n, and the tile is
dequantised in registers before its dot, rounded once to x's dtype as `fused_moe_fp8_ref` rounds the weights:

    acc[m, n] += sum_{k in step} x[m, k] * act(q[n, k] * s[e, row(n), k0 / bk])     (fp32 accumulate)

with row(n) = n // bn (gate rows, down), ceil(I / bn) + n // bn (up rows: their own blocks). (Scaling each step's
partial sums instead needs a second [BLOCK_M, BLOCK_N] fp32 tile per accumulator: the gated 64 x 128 tile then
spills, tests/test_moe_fp8_codegen.py.) The conversion, ~3 instructions a weight, is shared by the BLOCK_M rows of
the tile. Weight traffic is halved: ceil(rows_e / BLOCK_M) * 3*I*H bytes per used expert, plus E*3*I*H / (bn*bk) * 4
of scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.fp8_mm import A16_BF16, A16_FP16, PLAIN
from orinfer.kernels.gemv import interpreting
from orinfer.kernels.moe_align import MoeAlignment, moe_align
from orinfer.kernels.moe_config import MoeConfig, Tile

GROUP_M = 8


@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b with fp32 accumulation; DOT_F32: both widened to fp32 with exact products (fp32 / mixed mode)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b, acc)


@triton.jit
def _dequant_tile(q, s, act_ty: tl.constexpr):
    """An e4m3 weight tile q [K, N] inside one scale column times its columns' scales s [N] (fp32), rounded once to
    act_ty: the weights `fused_moe_fp8_ref` multiplies by, for the tensor cores to accumulate in place."""
    return (q.to(tl.float32) * s[None, :]).to(act_ty)


@triton.jit
def _swiglu(g, u, act_ty: tl.constexpr):
    """silu(g) * u from fp32 sums with the unfused path's roundings: g and u to act_ty, silu, then the product."""
    g = g.to(act_ty).to(tl.float32)
    u = u.to(act_ty).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(act_ty).to(tl.float32)
    return (s * u).to(act_ty)


@triton.jit
def band_tile(block_expert_ptr, num_blocks, N_OUT, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(block of sorted rows, tile of output columns, its expert: -1 past the last segment) of this program: programs
    go in bands of GROUP_M row blocks, all column tiles of a band before the next, so that the blocks of one expert
    read its weight tiles from L2 while they are there."""
    pid = tl.program_id(0)
    band = GROUP_M * tl.cdiv(N_OUT, BLOCK_N)
    first_m = (pid // band) * GROUP_M
    band_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_m
    pid_n = (pid % band) // band_m
    return pid_m, pid_n, tl.load(block_expert_ptr + pid_m)


@triton.jit
def grouped_rows(sorted_ptr, pid_m, pid_n, A_ROWS, N_OUT, TOP_K: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(sorted rows offs_m, their pairs, the A operand's rows, output columns offs_n, their clamped int64 rn) of tile
    (pid_m, pid_n): up (GATED) gathers each pair's token (padding pairs read the last one), down reads h in sorted
    order; columns past N_OUT re-read the last (never stored)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m)
    if GATED:
        rows = tl.minimum(pairs // TOP_K, A_ROWS - 1)
    else:
        rows = offs_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, pairs, rows, offs_n, tl.minimum(offs_n, N_OUT - 1).to(tl.int64)


@triton.jit
def tile_operands(a_ptr, w_ptr, s_ptr, rows, rn, expert, stride_am, stride_we, stride_wn, stride_se, stride_sn,
                  N_OUT, UP_SROW, BN: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile's first K step: (offs_k, the A rows' pointers [BLOCK_M, BLOCK_K], the expert's gate (or only) and up
    weight tiles as W^T [BLOCK_K, BLOCK_N], K-major, and for FP8 weights each row's block-scale pointer, gate and up
    [BLOCK_N]: scale row rn // BN, the up rows' from UP_SROW on)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    wg_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rn[None, :] * stride_wn + offs_k[:, None]
    sg_ptrs = s_ptr + expert.to(tl.int64) * stride_se + (rn // BN) * stride_sn
    return offs_k, a_ptrs, wg_ptrs, wg_ptrs + N_OUT * stride_wn, sg_ptrs, sg_ptrs + UP_SROW * stride_sn


@triton.jit
def load_step(a_ptrs, wg_ptrs, wu_ptrs, k0, offs_k, K, GATED: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step's tiles: a [BLOCK_M, BLOCK_K], the gate (or only) weight tile [BLOCK_K, BLOCK_N] and (GATED) the up
    one, inputs past K as zeros; not GATED, the weight tile stands in for the up one (unused)."""
    if EVEN_K:
        a = tl.load(a_ptrs)
        wg = tl.load(wg_ptrs)
        wu = tl.load(wu_ptrs) if GATED else wg
    else:
        k_in = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=k_in[None, :], other=0.0)
        wg = tl.load(wg_ptrs, mask=k_in[:, None], other=0.0)
        wu = tl.load(wu_ptrs, mask=k_in[:, None], other=0.0) if GATED else wg
    return a, wg, wu


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_blocks, A_ROWS, N_OUT, K,
                    N_PAIRS, stride_am, stride_we, stride_wn, stride_se, stride_sn, UP_SROW, stride_om,
                    TOP_K: tl.constexpr, GATED: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n, expert = band_tile(block_expert_ptr, num_blocks, N_OUT, BLOCK_N, GROUP_M)
    if expert >= 0:
        offs_m, pairs, rows, offs_n, rn = grouped_rows(sorted_ptr, pid_m, pid_n, A_ROWS, N_OUT, TOP_K, GATED, BLOCK_M,
                                                       BLOCK_N)
        offs_k, a_ptrs, wg_ptrs, wu_ptrs, sg_ptrs, su_ptrs = tile_operands(
            a_ptr, w_ptr, s_ptr, rows, rn, expert, stride_am, stride_we, stride_wn, stride_se, stride_sn, N_OUT,
            UP_SROW, BN, BLOCK_K)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a, wg, wu = load_step(a_ptrs, wg_ptrs, wu_ptrs, k0, offs_k, K, GATED, EVEN_K)
            if FP8:
                kb = k0 // BK
                wg = _dequant_tile(wg, tl.load(sg_ptrs + kb), a.dtype)
                if GATED:
                    wu = _dequant_tile(wu, tl.load(su_ptrs + kb), a.dtype)
            acc_g = _mma(a, wg, acc_g, DOT_F32)
            if GATED:
                acc_u = _mma(a, wu, acc_u, DOT_F32)
            a_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
            wu_ptrs += BLOCK_K
        act_ty = out_ptr.dtype.element_ty
        n_ok = (offs_n < N_OUT)[None, :]
        if GATED:
            dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(dst, _swiglu(acc_g, acc_u, act_ty), mask=n_ok)
        else:
            dst = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(dst, acc_g.to(act_ty), mask=(pairs < N_PAIRS)[:, None] & n_ok)


@triton.jit
def _sum_kernel(y_ptr, w_ptr, out_ptr, H, stride_y, stride_o, ROW_T, ROW_J, J: tl.constexpr, HAS_W: tl.constexpr,
                BLOCK: tl.constexpr):
    """out[t, n] = sum_{j < J} (w[t, j] *) y[t*ROW_T + j*ROW_J, n] in fp32, rounded once; j in order."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(J):
        v = tl.load(y_ptr + (t * ROW_T + j * ROW_J).to(tl.int64) * stride_y + offs, mask=mask, other=0.0)
        if HAS_W:
            acc += v.to(tl.float32) * tl.load(w_ptr + t * J + j)
        else:
            acc += v.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def dot_f32(x: torch.Tensor, w: torch.Tensor) -> bool:
    """fp32 / mixed inputs (and the CPU interpreter, which has no 16-bit dot) take the exact fp32 dots."""
    return x.dtype == torch.float32 or w.dtype == torch.float32 or interpreting()


def fp8_mode(x: torch.Tensor) -> int:
    """How FP8 weight tiles meet x on the tensor cores (`fp8_mm`'s modes): fp32 x and the interpreter take PLAIN."""
    if x.dtype == torch.float32 or interpreting():
        return PLAIN
    return A16_FP16 if x.dtype == torch.float16 else A16_BF16


def scale_args(w: torch.Tensor, scale: torch.Tensor | None, block_size: tuple[int, int] | None, gated: bool
               ) -> dict:
    """The scale arguments of the expert kernels: FP8 weights' scale tensor, its strides, the up rows' first scale
    row (gated) and the block; for 16-bit weights placeholders that no load reads."""
    if scale is None:
        return dict(s_ptr=w, stride_se=0, stride_sn=0, UP_SROW=0, FP8=False, BN=1, BK=1)
    bn, bk = block_size
    up_srow = triton.cdiv(w.shape[1] // 2, bn) if gated else 0
    return dict(s_ptr=scale, stride_se=scale.stride(0), stride_sn=scale.stride(1), UP_SROW=up_srow, FP8=True,
                BN=bn, BK=bk)


def _launch_grouped(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: MoeAlignment, n_out: int,
                    a_rows: int, n_pairs: int, top_k: int, gated: bool, tile: Tile,
                    scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    k = a.shape[1]
    num_blocks = align.block_expert.numel()
    grid = (num_blocks * triton.cdiv(n_out, tile.block_n),)
    _grouped_kernel[grid](
        a_ptr=a, w_ptr=w, out_ptr=out, sorted_ptr=align.sorted_pairs, block_expert_ptr=align.block_expert,
        num_blocks=num_blocks, A_ROWS=a_rows, N_OUT=n_out, K=k, N_PAIRS=n_pairs, stride_am=a.stride(0),
        stride_we=w.stride(0), stride_wn=w.stride(1), stride_om=out.stride(0), TOP_K=top_k, GATED=gated,
        DOT_F32=dot_f32(a, w), BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=GROUP_M, EVEN_K=k % tile.block_k == 0, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **scale_args(w, scale, block_size, gated))
    return out


def grouped_up(x: torch.Tensor, w13: torch.Tensor, align: MoeAlignment, top_k: int, tile: Tile,
               scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """h [P, I] in x's dtype: SwiGLU of the gate/up GEMM for every sorted row (padding rows hold garbage). `scale`
    and `block_size`: w13 is FP8 with these block scales."""
    inter = w13.shape[1] // 2
    h = torch.empty(align.sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    return _launch_grouped(x, w13, h, align, inter, x.shape[0], x.shape[0] * top_k, top_k, True, tile, scale,
                           block_size)


def grouped_down(h: torch.Tensor, w2: torch.Tensor, align: MoeAlignment, n_pairs: int, tile: Tile,
                 scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """y [N, H] in h's dtype: row p = h's row of pair p times its expert's down weight (no routing weight)."""
    y = torch.empty(n_pairs, w2.shape[1], dtype=h.dtype, device=h.device)
    return _launch_grouped(h, w2, y, align, w2.shape[1], h.shape[0], n_pairs, 1, False, tile, scale, block_size)


def moe_sum(y: torch.Tensor, weights: torch.Tensor | None, tokens: int, terms: int, row_t: int, row_j: int,
            out_dtype: torch.dtype) -> torch.Tensor:
    """out [tokens, H]: out[t] = sum_{j < terms} (weights[t, j] *) y[t*row_t + j*row_j] in fp32, rounded once: the
    combine of the k expert outputs (row_t = k, row_j = 1, with weights) or of split partial sums (no weights)."""
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_kernel[(tokens, triton.cdiv(hidden, block))](
        y, y if weights is None else weights, out, hidden, y.stride(0), out.stride(0), row_t, row_j, J=terms,
        HAS_W=weights is not None, BLOCK=block, num_warps=4)
    return out


def fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, cfg: MoeConfig, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                      block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """The grouped path of `fused_moe` (inputs checked by the caller): align, up, down, sum. Five launches.
    `scales` (s13, s2) with `block_size`: FP8 experts (the config's block_k dividing bk: `moe_fp8.fp8_config`)."""
    tokens, top_k = topk_ids.shape
    s13, s2 = scales if scales is not None else (None, None)
    align = moe_align(topk_ids, w13.shape[0], cfg.block_m)
    h = grouped_up(x, w13, align, top_k, cfg.up, s13, block_size)
    y = grouped_down(h, w2, align, tokens * top_k, cfg.down, s2, block_size)
    return moe_sum(y, topk_weights, tokens, top_k, top_k, 1, x.dtype)
