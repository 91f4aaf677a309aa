"""FP8 routed experts for ONE token (T == 1): the experts as one-row FP8 GEMVs in `fp8_gemv`'s chunked form, reading
e4m3 bytes at close to HBM bandwidth (the "gemv" path of `fused_moe_fp8`; `kernels/moe_ops.py` picks it).

Math (`fused_moe_fp8_ref`, up to summation order and the weights' rounding to x's dtype, which is skipped: the fp32 sum
of q * s * x, as the other FP8 decode kernels): x [1, H] fp16/bf16, ids / weights [1, k], w13 e4m3 [E, 2I, H] + s13
fp32 [E, 2 ceil(I/bn), ceil(H/bk)], w2 e4m3 [E, H, I] + s2 fp32 [E, ceil(H/bn), ceil(I/bk)] (`kernels/moe_fp8.py`).

    h[j]   = SwiGLU(x Wg_e^T, x Wu_e^T)          e = ids[j]; g, u and silu(g) rounded to x's dtype (`moe_gemm._swiglu`)
    out[n] = sum_j w[j] * round(h[j] . Wd_{e_j}[n, :])     fp32, pairs j in order; rounded once to x's dtype

Each weight row is read as `fp8_gemv` reads it: in chunks of 16 bytes (one LDG.128 per thread), a chunk inside one
scale block (bk % 16 == 0), its 16 products summed in registers and its scale applied once (`fp8_gemv._chunk_sums`).
Where the 128-wide path of `kernels/moe_decode.py` (block_m 1) keeps a few 128-byte loads in flight per program and
multiplies every weight by its scale, a program here loads a whole [CH, BLOCK_N, 16] tile (thousands of bytes) at
once. Two launches, no host sync, grids and buffers fixed by (k, E, H, I) and the config: CUDA-graph capturable.

  * `_gemv_up_kernel`, grid (k, cdiv(I, BLOCK_N)): program (j, b) reads e = ids[j] on the device and runs
    `fp8_gemv._rows_loop` over w13[e]'s gate rows b*BLOCK_N.. and the matching up rows (I further; their scales from
    scale row ceil(I/bn) on) against x, all of H in steps of BLOCK_K; SwiGLU; h [k, I] row j. A token's ids are
    distinct, so every pair is the only one of its expert: no leader election as on the multi-token path.
  * `_gemv_down_kernel`, grid (cdiv(H, BLOCK_N),): program b owns BLOCK_N output rows and reads those rows of every
    pair's w2[e_j] (PAIRS pairs per step side by side in one tile [PAIRS * BLOCK_I / 16 chunks, BLOCK_N, 16], h[j]
    in the matching layout; `fp8_gemv._load_x_chunks`), so one program has all of its k * I * BLOCK_N bytes in flight
    at once instead of k short loops, and sums the pairs in its registers: no partial sums in memory, no third
    launch, deterministic. Per pair: the chunk sums reduced to y [BLOCK_N], rounded to x's dtype, times w[j], added
    in pair order. k and I are constexprs (one pair per model): the steps over pair groups (k > PAIRS) and over I
    (I > BLOCK_I) are unrolled, and pair slots past k (k = 9 in 16 slots) are masked, mostly at compile time.

An id outside 0..E-1 (a CUDA graph's padding rows route garbage) selects no expert: its up programs return at once,
its down chunks are masked (no byte of w2, s2 or h is read) and it adds nothing. Any k works (top-k + 1 with a shared
expert folded in as one more slot, say); PDL as the other decode kernels (`kernels/pdl.py`).

Traffic at batch 1: k * 3 * I * H bytes of weights + their scales (1/bn/bk * 4 per weight) + x (2H per up program,
from L2) + h (2 * PAIRS * BLOCK_I per down program and step, from L2). Qwen3.5-35B-A3B FP8 (E 256, H 2048, I 512,
k 8): 16.8 MB up + 8.4 MB down per layer, 3.9 + 2.0 us at 4.3 TB/s (H200); Qwen3-30B-A3B-FP8 (E 128, I 768): 25.2 +
12.6 MB.

The same two kernels run 16-bit experts (bf16 / fp16 weights of x's dtype, no scales; `kernels/moe_gemv16.py` holds
their tiles and entry point): CODES = FLOAT16 and chunks of VEC = 8 weights, still one 16-byte load; the scale
pointers are never read. `gemv_up` / `gemv_down` take that form when called without scales (s = None).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.fp8_gemv import _chunk_inputs, _chunk_sums, _load_x_chunks, _rows_loop, _scale_rows
from orinfer.kernels.moe_config import GEMV, MoeConfig, Tile
from orinfer.kernels.moe_gemm import _swiglu
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.tiles import E4M3, FLOAT16

VEC = 16        # FP8 weights per chunk: one 16-byte load (16-bit weights: 8; the kernels take it as a constexpr)

# Tiles (block_n, block_k, num_warps, num_stages = 1), chosen as `fp8_gemv`'s defaults (8 16-byte weight loads in
# flight per thread, all of a row's K in one step). Up: DEFAULT_GATED's 2 gate + 2 up rows x 2048 inputs on 2 warps:
# Qwen3.5-35B-A3B's 8 experts are 2048 programs of 8 KB. Down: block_k counts the inputs of all pairs of a step
# (PAIRS pairs of BLOCK_I = next_pow2(I) each, side by side): 4 rows x 4096 (8 pairs x 512) on 4 warps, 16 KB a
# program, 512 programs for H = 2048; wider pair sets (k = 9, I = 768) take 8192 on 2 rows (`default_gemv_config`).
UP = Tile(2, 2048, 2, 1)
DOWN = Tile(4, 4096, 4, 1)
DOWN_BYTES = DOWN.block_n * DOWN.block_k          # the weight bytes a default down program aims at
# Candidates of `moe_tune` (FP8 tables, T = 1).
UP_CANDIDATES = [Tile(*t) for t in [(2, 2048, 2, 1), (4, 2048, 4, 1), (4, 1024, 2, 1), (2, 1024, 1, 1),
                                    (4, 2048, 2, 1), (1, 2048, 2, 1), (1, 2048, 1, 1), (8, 2048, 8, 1)]]
DOWN_CANDIDATES = [Tile(*t) for t in [(4, 4096, 4, 1), (2, 4096, 2, 1), (1, 4096, 2, 1), (2, 8192, 4, 1),
                                      (4, 2048, 2, 1), (8, 2048, 4, 1), (1, 8192, 4, 1), (8, 4096, 8, 1)]]


def default_gemv_config(top_k: int, inter: int, up: Tile = UP, down: Tile = DOWN) -> MoeConfig:
    """The gemv path's config for k pairs of width I: `up`, and a down tile whose steps take every pair side by side
    (up to 2 * down.block_k inputs a step), with as many rows (a power of two, at most 8) as keep a program's tile of
    all its steps (padded pair slots and inputs included) within down's weights (FP8: `DOWN_BYTES`; the 16-bit
    tiles of `moe_gemv16` pass theirs)."""
    tile = down._replace(block_k=min(triton.next_power_of_2(top_k) * triton.next_power_of_2(inter), 2 * down.block_k))
    pairs, block_i = down_steps(top_k, inter, tile)
    rows = min(8, max(1, down.block_n * down.block_k // (triton.cdiv(top_k, pairs) * pairs * block_i)))
    return MoeConfig(GEMV, 1, up, tile._replace(block_n=1 << (rows.bit_length() - 1)))


@triton.jit
def _gemv_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, ids_ptr, E, I, H, stride_we, stride_wn, stride_se, stride_sn,
                    UP_SROW, stride_hm, BN: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, CODES: tl.constexpr, VEC: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p)
    if (e >= 0) & (e < E):                       # an id outside 0..E-1 selects no expert: nothing read or stored
        CH: tl.constexpr = BLOCK_K // VEC
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = tl.minimum(offs_n, I - 1)           # rows past I re-read row I-1 and are not stored
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        wg_ptrs = w_e + rn.to(tl.int64)[None, :, None] * stride_wn + _chunk_inputs(CH, VEC)[:, None, :]
        sg_offs = _scale_rows(s_ptr, rn, BN, False)[None, :] * stride_sn
        acc_g, acc_u = _rows_loop(x_ptr, wg_ptrs, wg_ptrs + I * stride_wn, s_e, s_e, sg_offs,
                                  sg_offs + UP_SROW * stride_sn, H, BK, CODES, -1, True, BLOCK_N, BLOCK_K, EVEN_K,
                                  VEC)
        if PDL:
            gdc_launch_dependents()
        h = _swiglu(tl.sum(acc_g, axis=0), tl.sum(acc_u, axis=0), h_ptr.dtype.element_ty)
        tl.store(h_ptr + p * stride_hm + offs_n, h, mask=offs_n < I)


@triton.jit
def _gemv_down_kernel(h_ptr, w_ptr, s_ptr, wts_ptr, ids_ptr, out_ptr, E, H, stride_hm, stride_we, stride_wn,
                      stride_se, stride_sn, TOP_K: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      PAIRS: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr, CODES: tl.constexpr,
                      VEC: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    CHI: tl.constexpr = BLOCK_I // VEC          # chunks of one pair per step
    CH: tl.constexpr = PAIRS * CHI               # chunk c: pair slot c // CHI, inputs VEC (c % CHI) .. of the step
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, H - 1)               # rows past H re-read row H-1 and are not stored
    w_rows = rn.to(tl.int64)[None, :, None] * stride_wn
    s_rows = _scale_rows(s_ptr, rn, BN, False)[None, :] * stride_sn
    offs_c = tl.arange(0, CH)
    slot_c = offs_c // CHI
    in_c = (offs_c % CHI) * VEC                 # a chunk's first input within its pair's step
    kk = in_c[:, None] + tl.arange(0, VEC)[None, :]
    offs_j = tl.arange(0, PAIRS)
    act_ty = h_ptr.dtype.element_ty
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in tl.static_range(0, TOP_K, PAIRS):     # static: a step's loads need not wait for the last's sums
        pair_c = j0 + slot_c
        e_c = tl.load(ids_ptr + pair_c, mask=pair_c < TOP_K, other=-1)
        ok_c = (e_c >= 0) & (e_c < E)            # padding slots and invalid ids: masked, never an offset
        e_c = tl.where(ok_c, e_c, 0).to(tl.int64)
        w_ptrs = w_ptr + e_c[:, None, None] * stride_we + w_rows + kk[:, None, :]
        s_ptrs = s_ptr + e_c[:, None] * stride_se + s_rows
        h_ptrs = h_ptr + pair_c.to(tl.int64) * stride_hm + in_c
        acc = tl.zeros([CH, BLOCK_N], dtype=tl.float32)
        for i0 in tl.static_range(0, I, BLOCK_I):
            kmask = ((i0 + kk) < I) & ok_c[:, None]
            smask = ((i0 + in_c) < I) & ok_c
            x = _load_x_chunks(h_ptrs + i0, i0 + in_c, I, ok_c, CH, False, VEC)
            acc = _chunk_sums(acc, w_ptrs + i0, s_ptrs + ((i0 + in_c) // BK)[:, None], s_ptrs, x, kmask, smask,
                              CODES, -1, False)
        y = tl.sum(tl.reshape(acc, [PAIRS, CHI, BLOCK_N]), axis=1)             # [PAIRS, BLOCK_N] per pair
        pair_j = j0 + offs_j
        e_j = tl.load(ids_ptr + pair_j, mask=pair_j < TOP_K, other=-1)
        ok_j = (e_j >= 0) & (e_j < E)
        wt = tl.load(wts_ptr + pair_j, mask=ok_j, other=0.0)
        yw = tl.where(ok_j[:, None], y.to(act_ty).to(tl.float32) * wt[:, None], 0.0)
        for jj in tl.static_range(PAIRS):        # pair order (a row of zeros adds exactly nothing)
            out += tl.sum(tl.where((offs_j == jj)[:, None], yw, 0.0), axis=0)
    if PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < H)


def _codes(w: torch.Tensor, s: torch.Tensor | None, block_size: tuple[int, int] | None
           ) -> tuple[dict[str, int], torch.Tensor, tuple[int, int], tuple[int, int]]:
    """(CODES and VEC, the scale tensor or a stand-in pointer, its two strides, (bn, bk)) for e4m3 experts with block
    scales s, or for 16-bit experts (s None: the scale pointers are never read; chunks of 8 weights, 16 bytes)."""
    if s is None:
        return {"CODES": FLOAT16.value, "VEC": 16 // w.element_size()}, w, (0, 0), (1, 1 << 30)
    return {"CODES": E4M3.value, "VEC": VEC}, s, (s.stride(0), s.stride(1)), tuple(block_size)


def gemv_up(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor | None, block_size: tuple[int, int] | None,
            topk_ids: torch.Tensor, tile: Tile = UP) -> torch.Tensor:
    """h [k, I] in x's dtype: row j = SwiGLU of x [1, H] through expert ids[0, j] (rows of invalid ids unwritten);
    s13 / block_size None: w13 holds 16-bit weights (x's dtype)."""
    top_k, hidden, inter = topk_ids.shape[1], x.shape[1], w13.shape[1] // 2
    codes, s13, s_strides, (bn, bk) = _codes(w13, s13, block_size)
    h = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    block_k = min(tile.block_k, max(VEC, triton.next_power_of_2(hidden)))   # short rows: no masked-off chunks
    pdl = use_pdl(x)
    _gemv_up_kernel[(top_k, triton.cdiv(inter, tile.block_n))](
        x, w13, s13, h, topk_ids, w13.shape[0], inter, hidden, w13.stride(0), w13.stride(1), *s_strides,
        triton.cdiv(inter, bn), h.stride(0), BN=bn, BK=bk, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        EVEN_K=hidden % block_k == 0, **codes, PDL=pdl, num_warps=tile.num_warps, num_stages=1, launch_pdl=pdl)
    return h


def down_steps(top_k: int, inter: int, tile: Tile) -> tuple[int, int]:
    """(PAIRS, BLOCK_I) of a down tile: BLOCK_I = next_pow2(I) inputs (at most block_k) of each of PAIRS pairs per
    step, PAIRS * BLOCK_I <= block_k (or one pair of block_k inputs). A row of I = 768 is one step with a quarter of
    its chunks masked off rather than three steps of 256: ptxas does not issue a step's loads before the last step's
    sums (sm_90 SASS of the unrolled steps), so each step would be a round trip to HBM of its own."""
    block_i = max(VEC, min(triton.next_power_of_2(inter), tile.block_k))
    return max(1, min(triton.next_power_of_2(top_k), tile.block_k // block_i)), block_i


def gemv_down(h: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor | None, block_size: tuple[int, int] | None,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, tile: Tile = DOWN) -> torch.Tensor:
    """out [1, H] in h's dtype: sum_j weights[0, j] * round(h[j] Wd_{ids[0, j]}^T), fp32 in pair order; s2 /
    block_size None: w2 holds 16-bit weights (h's dtype)."""
    top_k, hidden, inter = topk_ids.shape[1], w2.shape[1], w2.shape[2]
    codes, s2, s_strides, (bn, bk) = _codes(w2, s2, block_size)
    pairs, block_i = down_steps(top_k, inter, tile)
    out = torch.empty(1, hidden, dtype=h.dtype, device=h.device)
    pdl = use_pdl(h)
    _gemv_down_kernel[(triton.cdiv(hidden, tile.block_n),)](
        h, w2, s2, topk_weights, topk_ids, out, w2.shape[0], hidden, h.stride(0), w2.stride(0), w2.stride(1),
        *s_strides, TOP_K=top_k, I=inter, BN=bn, BK=bk, PAIRS=pairs, BLOCK_I=block_i, BLOCK_N=tile.block_n,
        **codes, PDL=pdl, num_warps=tile.num_warps, num_stages=1, launch_pdl=pdl)
    return out


def fused_moe_fp8_gemv(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                       block_size: tuple[int, int], topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       cfg: MoeConfig | None = None) -> torch.Tensor:
    """The gemv path of `fused_moe_fp8` for x [1, H] (inputs checked by the caller: fp32 weights [1, k], contiguous
    ids [1, k], bk % 16 == 0); `cfg` a "gemv" config (None: `default_gemv_config`)."""
    cfg = cfg or default_gemv_config(topk_ids.shape[1], w2.shape[2])
    h = gemv_up(x, w13, s13, block_size, topk_ids, cfg.up)
    return gemv_down(h, w2, s2, block_size, topk_weights, topk_ids, cfg.down)
