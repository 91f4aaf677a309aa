"""FP8 block-wise W8A8 GEMM on FP8 tensor cores: x quantized per token and bk-wide group, the weight's block scales
applied per K step, fp32 accumulation, 16-bit output. Prefill, and the W8A8 alternative for decode batches.

Math: y [M, N] = sum_kb s_x[m, kb] * s_w[n / bn, kb] * (q_x[m, kb-block] . q_w[n, kb-block]) (+ b), rounded once to
the activation dtype (fp16 clamped to +-65504): exactly the fp32 product of the dequantised x and W
(`fp8_block_linear_a8_ref`) up to summation order. x is the MMA's M side (its per-row scales are 2 values a thread
in the wgmma accumulator layout; on the N side they would be 32), W^T [BLOCK_K, BLOCK_N] its N side; both operands
K-major in shared memory, as FP8 wgmma requires. Each K step of BLOCK_K (dividing bk) is one fresh `tl.dot` chain (4
m64nNk32 wgmmas, accumulated inside the tensor core, whose FP8 accumulation keeps ~14 mantissa bits) promoted into the
fp32 accumulator with its scales: one FFMA per accumulator element per step when the tile's rows share one weight scale
row (ROW_UNIFORM: BLOCK_N divides bn, Qwen's layers), the scale products precomputed per row.

Two ways in for x:
  `fp8_gemm`      q_x [M_pad, K] float8_e4m3fn and s_x [M, Kb] fp32, quantized beforehand (`kernels/fp8_quant.py`
                  `fp8_quantize_act`: one more launch, M*K*2 bytes read + M*K + 4*M*Kb written and read back).
  `fp8_gemm_act`  x [M, K] bf16/fp16 itself (A_QUANT): each K step is one whole group of every row (BLOCK_K == bk),
                  loaded in 16 bits and quantized in registers before its dot by the standalone kernel's own helper
                  (`fp8_quant.quantize_groups`: s = amax / 448, 1 for an all-zero group, q = e4m3(clamp(x * (1 / s)))
                  with IEEE divisions), so q_x, s_x and y are bit for bit those of the two launches on the same tile.
                  It saves the quantize launch (~2.5 us a call at M = 64, 4 calls a layer) and reads x at 2 bytes an
                  element per column tile instead of 1 (a decode batch's x, 64 x 4096 x 2 = 512 KB, stays in L2 beside
                  a weight of 16-96 MB), but every column tile quantizes its BLOCK_M x K slice of x again (rows past M
                  too: they repeat the last row): BLOCK_M * K * N / BLOCK_N elements of CUDA-core work whatever M is
                  (~14 SASS instructions a thread an element on sm_90: comment at SMALL_M), beside the weight read.
                  For 2..64 rows (decode batches); prefill keeps the two launches, whose x is quantized once.

Grid (tiles, SPLIT): tiles [BLOCK_M, BLOCK_N] in GROUP_M bands along M (consecutive programs share weight tiles in L2);
SPLIT > 1 splits K (`kernels/splitk.py`) for the few tiles of small M (each split quantizes its own groups).
Traffic: M*K (x, FP8; 16-bit with A_QUANT) per BLOCK_N weight rows + N*K per BLOCK_M rows + M*N*2 out (+ 2 * 4*M*N a
split of fp32 partials); at decode sizes bound by the weight read (N*K + scales), at prefill sizes by the FP8 MMA rate
(989 TFLOP/s dense bf16 -> 1979 FP8 on an H100 SXM), the target ~1.3x+ the bf16 GEMM's time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.fp8_block import FP8_DTYPE
from orinfer.kernels.fp8_gemv import _scale_rows, check_fp8_weight
from orinfer.kernels.fp8_mm import sm_count
from orinfer.kernels.fp8_quant import fp8_quantize_act, quantize_groups
from orinfer.kernels.gemv import check_device
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.splitk import counters, plan, splitk_store
from orinfer.kernels.tiles import grouped_tile, tile_rows


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, s_ptr, rb_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_am,
                     stride_as, stride_wn, stride_sn, stride_om, STEPS, BN: tl.constexpr, BK: tl.constexpr,
                     HAS_RB: tl.constexpr, ROW_UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP16: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLIT: tl.constexpr, EVEN_K: tl.constexpr, A_QUANT: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py
        gdc_wait()
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m, offs_n, rm, rn = tile_rows(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + offs_k[None, :]     # x [BLOCK_M, BLOCK_K], FP8 or 16-bit
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]     # W^T [BLOCK_K, BLOCK_N], K-major
    as_ptrs = as_ptr + rm
    if ROW_UNIFORM:
        sw_ptrs = s_ptr + ((pid_n * BLOCK_N) // BN) * stride_sn
    else:
        sw_ptrs = s_ptr + _scale_rows(rb_ptr, rn, BN, HAS_RB) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    step_lo = 0
    step_hi = tl.cdiv(K, BLOCK_K)
    if SPLIT > 1:
        step_lo = tl.program_id(1) * STEPS
        step_hi = tl.minimum(step_lo + STEPS, step_hi)
    for step in range(step_lo, step_hi):
        k0 = step * BLOCK_K
        kb = k0 // BK
        if EVEN_K:
            a = tl.load(a_ptrs + k0)
            w = tl.load(w_ptrs + k0)
        else:
            kmask = (k0 + offs_k) < K
            a = tl.load(a_ptrs + k0, mask=kmask[None, :], other=0.0)      # a partial group's zeros: amax unchanged
            w = tl.load(w_ptrs + k0, mask=kmask[:, None], other=0.0)
        if A_QUANT:
            # BLOCK_K == BK: the step is one whole group of every row, quantized as `fp8_quantize_act` would.
            a, sa = quantize_groups(a.to(tl.float32), 1)
        part = tl.dot(a, w)
        if not A_QUANT:
            sa = tl.load(as_ptrs + kb * stride_as)
        if ROW_UNIFORM:
            acc += part * (sa * tl.load(sw_ptrs + kb))[:, None]
        else:
            acc += part * sa[:, None] * tl.load(sw_ptrs + kb)[None, :]
    if PDL:
        gdc_launch_dependents()
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    splitk_store(acc, acc, ws_ptr, cnt_ptr, tl.program_id(0), out_ptr, b_ptr, rn, offs_m, offs_n, mask, M, N,
                 stride_om, SPLIT, HAS_BIAS, False, CLAMP16)


class Fp8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int         # clipped to the largest power of two dividing bk
    num_warps: int
    num_stages: int
    split_k: int = 1     # 0: `splitk.plan`'s choice


# Prefill: 128 x 128 tiles over two warpgroups (acc and the step's dot result 64 + 64 registers a thread, 165 in all;
# 128 x 256, or 128 x 128 on one warpgroup, spill), 32 KB of operands per stage, 4 stages. The loop is 153 SASS
# instructions a thread per K step, 64 of them the FFMAs that promote the step's dot (Triton waits for each wgmma
# before them, so they do not overlap the tensor cores; a one-step software pipeline in the source did not change
# that: Triton still waits at the end of the iteration). Small M (the W8A8 alternative for decode batches): 64-row
# tiles and split-K; 64 x 64 per run 358 (H100 sweep, M = 64, us a call with the separate quantize, qkv / o /
# gate_up / down): 20.9 / 22.4 / 45.7 / 40.4 against 36.9 / 27.2 / 60.8 / 73.3 for the 64 x 128 tile before it
# (torch._scaled_mm + quantize: 17.9 / 16.9 / 48.5 / 40.1). Candidates for `orinfer.bench.fp8_kernels --sweep`, the
# small-M ones (narrower tiles, deeper or shallower pipelines, a fixed split) for decode batches; the two 8-warp ones
# last for `fp8_gemm_act`, which quantizes x again in every column tile: its K step on sm_90 is ~14 SASS instructions a
# thread per x element of the tile (64 x 64 on 4 warps: 895 a step against 124 without A_QUANT), so a wider tile
# does less of it per output (64 x 128 on 8 warps: 503 a step, 136 registers; 64 x 256: 610, 228 registers).
PREFILL = Fp8GemmConfig(128, 128, 128, 8, 4)
SMALL_M = Fp8GemmConfig(64, 64, 128, 4, 3, 0)  # 3 stages, run 359: qkv 19.5, o 18.8, down 33.9 us (4: 20.7, 22.0, 40.2)
SMALL_M_ACT = SMALL_M     # `fp8_gemm_act`'s, apart so that its own sweep rows can promote another (none measured yet)
CANDIDATES = [Fp8GemmConfig(*c) for c in [(128, 128, 128, 8, 4), (128, 128, 128, 8, 3), (128, 64, 128, 4, 4),
                                          (64, 128, 128, 4, 4), (64, 128, 128, 4, 4, 0), (64, 64, 128, 4, 4, 0),
                                          (64, 32, 128, 4, 4, 0), (64, 64, 128, 4, 6, 0), (64, 64, 128, 4, 3, 0),
                                          (64, 64, 128, 4, 4, 2), (64, 32, 128, 4, 6, 0), (64, 128, 128, 8, 4, 0),
                                          (64, 256, 128, 8, 3, 0)]]


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             block_size: tuple[int, int], out_dtype: torch.dtype, row_block: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, cfg: Fp8GemmConfig | None = None) -> torch.Tensor:
    """y [M, N] in out_dtype for xq [M(_pad), K] float8_e4m3fn and x_scale [M, Kb] fp32 with stride(0) == 1 (as
    `fp8_quantize_act` returns them, group = bk; rows of xq past x_scale's M are ignored). Needs bk % 32 == 0."""
    check_device(xq)
    m, kb = x_scale.shape
    k = xq.shape[-1]
    n = check_fp8_weight(weight, scale, block_size, row_block, k, bias)
    bk = block_size[1]
    if xq.dim() != 2 or xq.dtype != FP8_DTYPE or xq.shape[0] < m or xq.stride(1) != 1 or bk % 32:
        raise ValueError(f"fp8_gemm takes a row-major float8_e4m3fn x [>= {m}, K] and bk % 32 == 0, got "
                         f"{tuple(xq.shape)} {xq.dtype}, bk {bk}")
    if kb != -(-k // bk) or x_scale.stride(0) != 1 or x_scale.dtype != torch.float32:
        raise ValueError(f"x_scale must be an fp32 [{m}, {-(-k // bk)}] view with stride(0) == 1, got "
                         f"{tuple(x_scale.shape)} {tuple(x_scale.stride())} {x_scale.dtype}")
    cfg = cfg or default_config(m)
    return _launch(xq, x_scale, x_scale.stride(1), m, n, k, weight, scale, block_size, out_dtype, row_block, bias, cfg,
                   min(cfg.block_k, bk & -bk), a_quant=False)


def default_config(m: int, a_quant: bool = False) -> Fp8GemmConfig:
    """The tile for M rows of x: up to 64 (decode batches) SMALL_M, or SMALL_M_ACT when the GEMM quantizes x; PREFILL
    beyond."""
    return PREFILL if m > 64 else SMALL_M_ACT if a_quant else SMALL_M


def fuses_act_quant(block_size: tuple[int, int], cfg: Fp8GemmConfig) -> bool:
    """Whether `fp8_gemm_act` quantizes x inside the GEMM for this block size and tile: a K step must be one whole
    group (BLOCK_K == bk, so a power-of-two bk >= 32 no deeper than the tile's block_k); otherwise it runs
    `fp8_quantize_act` + `fp8_gemm` (the same result in two launches)."""
    bk = block_size[1]
    return 32 <= bk <= cfg.block_k and bk & (bk - 1) == 0


def fp8_gemm_act(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                 out_dtype: torch.dtype, row_block: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 cfg: Fp8GemmConfig | None = None) -> torch.Tensor:
    """y [M, N] in out_dtype for x [M, K] bf16/fp16: `fp8_gemm(*fp8_quantize_act(x, bk), ...)` bit for bit (the
    same tile and split: the same q, s, dots and promotions), in one launch where `fuses_act_quant` (module
    docstring, A_QUANT), else in those two. Needs a power-of-two bk >= 32 (Qwen: 128)."""
    check_device(x)
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"fp8_gemm_act takes a 2-D bf16/fp16 x [M, K], got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    n = check_fp8_weight(weight, scale, block_size, row_block, k, bias)
    bk = block_size[1]
    if bk < 32 or bk & (bk - 1):
        raise ValueError(f"fp8_gemm_act needs a power-of-two bk >= 32 (one K step a group), got bk {bk}")
    cfg = cfg or default_config(m, a_quant=True)
    if not fuses_act_quant(block_size, cfg):
        xq, xs = fp8_quantize_act(x, bk)
        return fp8_gemm(xq, xs[:m], weight, scale, block_size, out_dtype, row_block, bias, cfg)
    if x.stride(1) != 1:
        x = x.contiguous()
    return _launch(x, x, 0, m, n, k, weight, scale, block_size, out_dtype, row_block, bias, cfg, bk, a_quant=True)


def _launch(a: torch.Tensor, a_scale: torch.Tensor, stride_as: int, m: int, n: int, k: int, weight: torch.Tensor,
            scale: torch.Tensor, block_size: tuple[int, int], out_dtype: torch.dtype, row_block: torch.Tensor | None,
            bias: torch.Tensor | None, cfg: Fp8GemmConfig, block_k: int, a_quant: bool) -> torch.Tensor:
    """Allocates y [m, n] and launches `_fp8_gemm_kernel` on checked arguments (a: FP8 xq with its scales a_scale,
    or 16-bit x when a_quant)."""
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype must be fp32, fp16 or bf16, got {out_dtype}")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    bn, bk = block_size
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    steps = triton.cdiv(k, block_k)
    split, per_split = plan(tiles, steps, cfg.split_k, sm_count(a.device))
    ws = torch.empty(split, 1, m, n, dtype=torch.float32, device=a.device) if split > 1 else out
    pdl = use_pdl(a)
    _fp8_gemm_kernel[(tiles, split)](
        a, a_scale, weight, scale, scale if row_block is None else row_block, out if bias is None else bias, out, ws,
        counters(a.device) if split > 1 else scale, m, n, k, a.stride(0), stride_as, weight.stride(0),
        scale.stride(0), out.stride(0), per_split, BN=bn, BK=bk, HAS_RB=row_block is not None,
        ROW_UNIFORM=row_block is None and bn % cfg.block_n == 0, HAS_BIAS=bias is not None,
        CLAMP16=out_dtype == torch.float16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8,
        SPLIT=split, EVEN_K=k % block_k == 0, A_QUANT=a_quant, PDL=pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=pdl)
    return out
