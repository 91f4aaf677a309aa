"""W8A8 grouped expert GEMMs for FP8 block-wise experts (prefill): the activations quantized per token and bk-wide
group as the dense W8A8 GEMM quantizes them (`kernels/fp8_quant.py`), both operands straight from e4m3 into the FP8
tensor cores, the scales applied to each K step's partial sums.

Why: the W8A16 grouped GEMMs (`kernels/moe_gemm.py`) widen every e4m3 weight to 16 bits in registers before their
bf16 dots, once per block of BLOCK_M rows. At prefill sizes that conversion, not the weight bytes, bounds them:
Qwen3.5-35B-A3B's FP8 experts took 605 us a layer at 2048 tokens (tuned, H200) against 188 us for reading their
808 MB, slower than its 16-bit experts read twice the bytes in (534 us). FP8 wgmma reads e4m3 from shared memory
as it is and runs at twice the bf16 rate.

Math, with `moe_gemm`'s names (sorted rows r of expert e, pair p, token p // k) and q_z, s_z the e4m3 codes and
scales of `fp8_quantize_act` (group bk) of an activation z:

    up   (GATED): g = sum_kb s_x[t, kb] s_g[e, n / bn, kb] (q_x[t, kb] . q_g[e, n, kb])    likewise u (up rows' blocks)
                  h[r, :] = silu(g) * u                    rounded as `moe_gemm._swiglu` (to x's dtype)
                  (q_h, s_h) = quantize(h[r, :])           in the epilogue: the tile's BLOCK_N = bk columns are one
                                                           group, so a row's amax is a reduction inside the tile
    down:         y[p, :] = sum_kb s_h[r, kb] s_d[e, n / bn, kb] (q_h[r, kb] . q_d[e, n, kb]) rounded to x's dtype
    sum:          `moe_gemm.moe_sum` (the routing weights, fp32, rounded once)

`fused_moe_fp8_a8_ref` is the reference (dequantised codes in fp64); the kernels match it up to summation order and
the tensor cores' FP8 accumulation inside a K step (`kernels/fp8_gemm.py`). q_h is what `fp8_quantize_act(h)` would
make of h, bit for bit (`fp8_quant.quantize_groups`), without h going through memory in 16 bits.

Kernel: `moe_gemm`'s grouped layout and band order (`band_tile`), BLOCK_K = bk (one scale column a step). Operands in
FP8 halve the shared memory a stage takes against the W8A16 kernel's 16-bit x. Traffic per used expert:
ceil(rows_e / BLOCK_M) * 3*I*H weight bytes (L2 shares them within a band) + x's codes gathered (P*H) + q_h written
and read (2*P*I) + y (2 * 2*N*H) + scales.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.fp8_block import fp8_quantize_act_ref
from orinfer.fp8_config import ACTIVATIONS
from orinfer.kernels.fp8_quant import act_buffers, fp8_quantize_act, quantize_groups
from orinfer.kernels.gemv import TL_DTYPES
from orinfer.kernels.moe_align import moe_align
from orinfer.kernels.moe_config import A8, W8A8_LABEL, MoeConfig, Tile, table_lookup
from orinfer.kernels.moe_fp8 import dequantize_experts
from orinfer.kernels.moe_gemm import GROUP_M, _swiglu, band_tile, grouped_rows, load_step, moe_sum, tile_operands

# "w8a8": prefill batches of FP8 experts take these kernels (from MIN_TOKENS tokens); "w8a16": the grouped W8A16
# GEMMs at every size. Read at import from ORINFER_FP8_EXPERTS (benchmarks may set the attribute); its default is
# "w8a16" under ORINFER_FP8_ACTIVATIONS=16bit (`fp8_config.ACTIVATIONS`).
MODE = os.environ.get("ORINFER_FP8_EXPERTS", "w8a16" if ACTIVATIONS == "16bit" else "w8a8")
# Below this many tokens the W8A16 kernels' tuned tiles win or tie (H200, graph replays of one layer, NOTES run 457:
# Qwen3.5-35B-A3B FP8 at 256 tokens 291 us W8A8 against 272, Qwen3-30B-A3B 208 against 255; at 512 286 / 239 against
# 449 / 325).
MIN_TOKENS = 512


class A8Config(NamedTuple):
    block_m: int    # sorted rows a tile (the alignment's block)
    up: Tile        # block_n is bk (one quantization group of h a tile); block_k is bk
    down: Tile      # block_k is bk
    # Where a tile's weight rows share one scale row (bn a multiple of block_n: Qwen's 128-row blocks), each K step's
    # dot is promoted by one FFMA an element, row scale times the tile's one weight scale, instead of an outer product
    # of the row and column scales (sm_90, 64-row gated tile: 253 -> 187 registers, K loop 294 -> 174 instructions).
    uniform_scale: bool = False


# From 1024 tokens: two warpgroups on 64 x 128 tiles (each thread holds 32 + 32 fp32 accumulators, gate and up, and
# the K step's two partial dots; 253 registers, no spills, 120 KB of shared memory at 3 stages). Fewer tokens leave
# ~2-9 rows an expert at Qwen's 128-256 experts: 32-row tiles on one warpgroup waste less on padding rows. H200, us
# a layer (run 457), 35B-A3B / 30B-A3B: 512 tokens 383 / 272 with 64 rows, 286 / 239 with 32; 1024 375 / 345 against
# 408 / 385; 2048 595 / 517 against 617 / 641 (W8A16: 768 / 669). 4 stages or a 64-wide down tile were slower.
# uniform_scale (run 460, H200, us a layer, 35B-A3B / 30B-A3B): 64-row tiles 1024 tokens 400 / 350 -> 379 / 329,
# 2048 534 / 531 -> 502 / 492, 4096 835 / 879 -> 770 / 797; on the 32-row tiles at 512 tokens 307 / 255 -> 306 / 265.
PREFILL = A8Config(64, Tile(128, 128, 8, 3), Tile(128, 128, 4, 3), uniform_scale=True)
FEW_ROWS = A8Config(32, Tile(128, 128, 4, 3), Tile(128, 128, 4, 3))
WIDE_FROM = 1024  # tokens from which PREFILL's 64-row tiles run


def default_config(tokens: int) -> A8Config:
    """The tiles for a call of `tokens` tokens."""
    return PREFILL if tokens >= WIDE_FROM else FEW_ROWS


def from_config(cfg: MoeConfig) -> A8Config:
    """The A8Config of an "a8" MoeConfig (a table entry, or one the tuner forces)."""
    return A8Config(cfg.block_m, cfg.up, cfg.down, cfg.uniform_scale)


def as_config(cfg: A8Config) -> MoeConfig:
    """The "a8" MoeConfig of an A8Config (what a table stores)."""
    return MoeConfig(A8, cfg.block_m, cfg.up, cfg.down, 1, cfg.uniform_scale)


def tuned_config(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> A8Config | None:
    """The current GPU's W8A8 table entry (`moe_tune`, label W8A8_LABEL) for x's tokens and these experts, None
    without one (the call then takes `default_config`). Host-only: safe inside CUDA-graph capture."""
    experts, two_inter, hidden = w13.shape
    cfg = table_lookup(x, experts, hidden, two_inter // 2, top_k, W8A8_LABEL)
    return from_config(cfg) if cfg is not None and cfg.path == A8 else None


def supported(x: torch.Tensor, block_size: tuple[int, int]) -> bool:
    """Whether the W8A8 kernels take x with experts in these blocks: 16-bit x (fp32 keeps the exact W8A16 path) and
    bk a power of two >= 32 (a K step is one scale column, and FP8 dots step K by 32). Any bn: the scales are looked
    up per weight row."""
    bk = block_size[1]
    return x.dtype in (torch.float16, torch.bfloat16) and bk >= 32 and bk & (bk - 1) == 0


def takes(x: torch.Tensor, tokens: int, block_size: tuple[int, int]) -> bool:
    """Whether `fused_moe_fp8` runs this call through the W8A8 kernels (MODE, MIN_TOKENS, `supported`, a GPU)."""
    return MODE == "w8a8" and tokens >= MIN_TOKENS and x.is_cuda and supported(x, block_size)


@triton.jit
def _grouped_a8_kernel(a_ptr, as_ptr, w_ptr, s_ptr, out_ptr, os_ptr, sorted_ptr, block_expert_ptr, num_blocks,
                       A_ROWS, N_OUT, K, N_PAIRS, stride_am, stride_as, stride_we, stride_wn, stride_se, stride_sn,
                       UP_SROW, stride_om, stride_os, ACT_TY: tl.constexpr, TOP_K: tl.constexpr,
                       GATED: tl.constexpr, BN: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       EVEN_K: tl.constexpr, ROW_UNIFORM: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of the up (GATED: SwiGLU, quantized h out) or down GEMM; module docstring.
    ACT_TY: x's dtype (h's rounding, y's dtype)."""
    pid_m, pid_n, expert = band_tile(block_expert_ptr, num_blocks, N_OUT, BLOCK_N, GROUP_M)
    if expert >= 0:
        offs_m, pairs, rows, offs_n, rn = grouped_rows(sorted_ptr, pid_m, pid_n, A_ROWS, N_OUT, TOP_K, GATED, BLOCK_M,
                                                       BLOCK_N)
        offs_k, a_ptrs, wg_ptrs, wu_ptrs, sg_ptrs, su_ptrs = tile_operands(
            a_ptr, w_ptr, s_ptr, rows, rn, expert, stride_am, stride_we, stride_wn, stride_se, stride_sn, N_OUT,
            UP_SROW, BN, BLOCK_K)
        as_ptrs = as_ptr + rows                                  # K block kb's scales at + kb * stride_as
        sg0_ptr = s_ptr + expert.to(tl.int64) * stride_se + ((pid_n * BLOCK_N) // BN) * stride_sn
        su0_ptr = sg0_ptr + UP_SROW * stride_sn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a, wg, wu = load_step(a_ptrs, wg_ptrs, wu_ptrs, k0, offs_k, K, GATED, EVEN_K)
            kb = k0 // BLOCK_K
            sa = tl.load(as_ptrs + kb * stride_as)
            if ROW_UNIFORM:     # the tile's weight rows share one scale row: one FFMA an element
                acc_g += tl.dot(a, wg) * (sa * tl.load(sg0_ptr + kb))[:, None]
                if GATED:
                    acc_u += tl.dot(a, wu) * (sa * tl.load(su0_ptr + kb))[:, None]
            else:
                acc_g += tl.dot(a, wg) * (sa[:, None] * tl.load(sg_ptrs + kb)[None, :])
                if GATED:
                    acc_u += tl.dot(a, wu) * (sa[:, None] * tl.load(su_ptrs + kb)[None, :])
            a_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
            wu_ptrs += BLOCK_K
        n_ok = (offs_n < N_OUT)[None, :]
        if GATED:
            h = _swiglu(acc_g, acc_u, ACT_TY)
            h = tl.where(n_ok, h.to(tl.float32), 0.0)            # the group's amax sees real columns only
            q, s = quantize_groups(tl.reshape(h, [BLOCK_M, 1, BLOCK_N]))
            dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(dst, tl.reshape(q, [BLOCK_M, BLOCK_N]).to(tl.float8e4nv), mask=n_ok)
            tl.store(os_ptr + pid_n * stride_os + offs_m, tl.reshape(s, [BLOCK_M]))
        else:
            dst = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(dst, acc_g.to(ACT_TY), mask=(pairs < N_PAIRS)[:, None] & n_ok)


def _launch(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
            out_scale: torch.Tensor | None, align, n_out: int, a_rows: int, n_pairs: int, top_k: int, gated: bool,
            tile: Tile, block_size: tuple[int, int], act_dtype: torch.dtype, uniform_scale: bool) -> None:
    bn, bk = block_size
    k = a.shape[1]
    num_blocks = align.block_expert.numel()
    _grouped_a8_kernel[(num_blocks * triton.cdiv(n_out, tile.block_n),)](
        a, a_scale, w, scale, out, out if out_scale is None else out_scale, align.sorted_pairs, align.block_expert,
        num_blocks, a_rows, n_out, k, n_pairs, a.stride(0), a_scale.stride(1), w.stride(0), w.stride(1),
        scale.stride(0), scale.stride(1), triton.cdiv(n_out, bn) if gated else 0, out.stride(0),
        0 if out_scale is None else out_scale.stride(0), ACT_TY=TL_DTYPES[act_dtype], TOP_K=top_k, GATED=gated,
        BN=bn, BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=bk, GROUP_M=GROUP_M, EVEN_K=k % bk == 0,
        ROW_UNIFORM=uniform_scale and bn % tile.block_n == 0,
        num_warps=tile.num_warps, num_stages=tile.num_stages)


def fused_moe_fp8_a8(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                     block_size: tuple[int, int], topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     cfg: A8Config | None = None) -> torch.Tensor:
    """`fused_moe_fp8_a8_ref`'s contract (inputs checked by `moe_ops.fused_moe_fp8`; `supported` true): quantize x,
    align, up (+ SwiGLU + quantize h), down, sum: seven launches (the alignment's three). `cfg` (default: by the token
    count) forces tiles; its `up.block_n` is replaced by bk (the tile is h's quantization group)."""
    tokens, top_k = topk_ids.shape
    cfg = cfg or default_config(tokens)
    bk = block_size[1]
    inter = w13.shape[1] // 2
    xq, xs = fp8_quantize_act(x, bk)                       # xs: [M_pad, Kb] view, stride (1, M_pad)
    align = moe_align(topk_ids, w13.shape[0], cfg.block_m)
    rows = align.sorted_pairs.numel()
    hq, hs = act_buffers(rows, inter, bk, x.device)        # hs: [Kb_I, P_pad]
    _launch(xq, xs, w13, s13, hq, hs, align, inter, tokens, tokens * top_k, top_k, True,
            cfg.up._replace(block_n=bk), block_size, x.dtype, cfg.uniform_scale)
    y = torch.empty(tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    _launch(hq, hs.t(), w2, s2, y, None, align, w2.shape[1], rows, tokens * top_k, 1, False, cfg.down, block_size,
            x.dtype, cfg.uniform_scale)
    return moe_sum(y, topk_weights, tokens, top_k, top_k, 1, x.dtype)


def _dequantized_act(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the W8A8 kernels see it: its per-token, per-group e4m3 codes times their scales, in fp64."""
    q, s = fp8_quantize_act_ref(x, group)
    return q.double() * s.double().repeat_interleave(group, dim=1)[:, :x.shape[1]]


def fused_moe_fp8_a8_ref(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                         block_size: tuple[int, int], topk_weights: torch.Tensor, topk_ids: torch.Tensor
                         ) -> torch.Tensor:
    """W8A8 FP8 experts (module docstring) -> [T, H] in x's dtype: x quantized per token and bk group, each pair's
    gate / up products in fp64 over the dequantised codes, rounded to x's dtype, SwiGLU rounded as the 16-bit path,
    h quantized the same way, the down products rounded to x's dtype, the weighted sum in fp32 rounded once."""
    bk = block_size[1]
    tokens, top_k = topk_ids.shape
    inter = w13.shape[1] // 2
    xd = _dequantized_act(x, bk)
    y = torch.zeros(tokens, top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    for expert in torch.unique(topk_ids).tolist():            # one expert's matrices dequantised at a time
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        d13 = dequantize_experts(w13[expert:expert + 1], s13[expert:expert + 1], block_size, True, torch.float64)[0]
        d2 = dequantize_experts(w2[expert:expert + 1], s2[expert:expert + 1], block_size, False, torch.float64)[0]
        gu = (xd[token] @ d13.T).to(x.dtype).float()
        g, u = gu[:, :inter], gu[:, inter:]
        h = ((g / (1.0 + torch.exp(-g))).to(x.dtype).float() * u).to(x.dtype)
        y[token, slot] = (_dequantized_act(h, bk) @ d2.T).to(x.dtype)
    out = (y.float() * topk_weights.float()[:, :, None]).sum(dim=1)
    return out.to(x.dtype)
