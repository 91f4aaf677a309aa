"""16-bit routed experts for ONE token (T == 1) as one-row GEMVs in 16-byte chunks: the "gemv" path of `fused_moe`
for bf16 / fp16 experts with x of their dtype (`kernels/moe_ops.py` runs it where the config names it: a table entry
or a forced config; without one, T = 1 keeps the "decode" path of `kernels/moe_decode.py`).

The kernels are those of the FP8 gemv path (`kernels/moe_fp8_decode.py`, called without scales): CODES = FLOAT16,
a chunk is VEC = 8 weights (one LDG.128 of bf16), its 8 products summed in the thread's registers, and no scale is
read. Math (`fused_moe_ref` up to summation order), x [1, H], ids / weights [1, k], w13 [E, 2I, H], w2 [E, H, I]:

    h[j]   = SwiGLU(x Wg_e^T, x Wu_e^T)          e = ids[j]; g, u and silu(g) rounded to x's dtype (`moe_gemm._swiglu`)
    out[n] = sum_j w[j] * round(h[j] . Wd_{e_j}[n, :])     fp32, pairs j in order; rounded once to x's dtype

  * up, grid (k, cdiv(I, BLOCK_N)): program (j, b) reads gate rows b*BLOCK_N.. of w13[ids[j]] and the matching up
    rows against x over all of H in steps of BLOCK_K, then SwiGLU: h [k, I].
  * down, grid (cdiv(H, BLOCK_N),): program b reads its BLOCK_N rows of every pair's w2[e_j] side by side (PAIRS
    pairs of BLOCK_I inputs a step) and sums the pairs in its registers, in pair order: no partial sums in memory.

Why: the decode path's 128-wide FMA loop (block_m 1) keeps only a few 128-byte loads in flight per program and ran at
36-41% of HBM bandwidth on Qwen3-30B-A3B; here a program loads all of its tile at once (8 16-byte loads a thread),
as the FP8 path that reads at ~60%. Ids outside 0..E-1 (CUDA-graph padding) select no expert and add nothing; any k
(k + 1 with a folded shared expert's slot); PDL; no host sync, grids from (k, E, H, I): CUDA-graph capturable.

Traffic at batch 1: k * 3 * I * H * 2 bytes of weights + x (2H per up program, from L2) + h (2 * PAIRS * BLOCK_I per
down program and step, from L2). Qwen3-30B-A3B (E 128, H 2048, I 768, k 8): 50.3 MB up + 25.2 MB down per layer,
15.0 + 7.5 us at 3.35 TB/s (H100).
"""

from __future__ import annotations

import torch

from orinfer.kernels.moe_config import MoeConfig, Tile
from orinfer.kernels.moe_fp8_decode import default_gemv_config, gemv_down, gemv_up

# Tiles (block_n, block_k, num_warps, num_stages = 1), by analogy with `gemv.ONE_ROW` (2 rows x 2048 bf16 = 8 KB a
# step on 2 warps: 8 16-byte loads in flight per thread) and the FP8 gemv tiles (all of a row's K in one step).
# Up: 1 gate + 1 up row x 2048 = the same 8 KB on 2 warps; Qwen3-30B-A3B's 8 experts are 6144 programs. Down: 2 rows
# x 4096 inputs (16 KB, 8 loads a thread on 4 warps); `default_gemv16_config` widens a step to every pair (k = 8,
# I = 768: 8192 inputs on 1 row). The candidates are what `moe_tune` times at T = 1 for bf16 / fp16 tables.
UP16 = Tile(1, 2048, 2, 1)
DOWN16 = Tile(2, 4096, 4, 1)
UP16_CANDIDATES = [Tile(*t) for t in [(1, 2048, 2, 1), (2, 2048, 4, 1), (2, 1024, 2, 1), (1, 1024, 1, 1),
                                      (2, 2048, 2, 1), (1, 2048, 1, 1), (4, 2048, 8, 1), (4, 512, 2, 1)]]
DOWN16_CANDIDATES = [Tile(*t) for t in [(2, 4096, 4, 1), (1, 4096, 2, 1), (1, 8192, 4, 1), (2, 2048, 2, 1),
                                        (4, 2048, 4, 1), (1, 8192, 8, 1), (4, 4096, 8, 1), (1, 2048, 1, 1)]]
DTYPES = (torch.bfloat16, torch.float16)


def default_gemv16_config(top_k: int, inter: int) -> MoeConfig:
    """The 16-bit gemv path's config for k pairs of width I (`moe_fp8_decode.default_gemv_config` with `UP16` and
    `DOWN16`: a down step takes every pair side by side, up to 8192 inputs, on as many rows as keep 16 KB)."""
    return default_gemv_config(top_k, inter, UP16, DOWN16)


def gemv16_supported(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether the 16-bit gemv path takes these experts: bf16 / fp16 weights with x of their dtype (fp32 and mixed
    calls need not take it)."""
    return w13.dtype in DTYPES and x.dtype == w13.dtype


def fused_moe_gemv16(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, cfg: MoeConfig | None = None) -> torch.Tensor:
    """The gemv path of `fused_moe` for x [1, H] with 16-bit experts of its dtype (inputs checked by the caller: fp32
    weights [1, k], contiguous ids [1, k]); `cfg` a "gemv" config (None: `default_gemv16_config`)."""
    cfg = cfg or default_gemv16_config(topk_ids.shape[1], w2.shape[2])
    h = gemv_up(x, w13, None, None, topk_ids, cfg.up)
    return gemv_down(h, w2, None, None, topk_weights, topk_ids, cfg.down)
