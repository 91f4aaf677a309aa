"""GEMV for decode: y = x W^T (+ b) for a handful of rows of x, reading every weight element exactly once.

Math: x [B, K] (B <= 16: decode), W [N, K] row-major (stride(1) == 1), b [N]; y [B, N] = x W^T + b. Products and
sums are fp32, the result is rounded once to x's dtype (as cuBLAS does). Mixed mode (fp32 x, 16-bit W): W is
widened to fp32 as it is loaded, so the math is the fp32 GEMM of `gemv_ref` without materialising an fp32 copy.

Traffic: N*K*sizeof(W) + B*K + B*N elements -> bandwidth-bound at decode batch sizes: the target time is
N*K*sizeof(W) / (HBM read bandwidth). For Qwen3-8B in bf16: qkv 6144x4096 = 50 MB (12 us on an H200 at 4.1 TB/s),
o 4096x4096 = 34 MB, down 4096x12288 = 101 MB, lm_head 151936x4096 = 1.24 GB (303 us).

Three inner loops, two in `_gemv_kernel` and one in `kernels.gemv_rows`; per problem shape the fastest of a few
configs of each, and of cuBLAS itself, is picked by timing them once (`_Tuner`; defaults where timing is impossible;
16-bit x and W take measured fixed configs, `fixed_config`):
  * FMA (B == 1): each program owns BLOCK_N output rows; per step it loads a [BLOCK_N, BLOCK_K] weight tile
    (coalesced 16-byte vectors along K), multiplies by x[k0:k0+BLOCK_K] and accumulates into a [BLOCK_N, BLOCK_K]
    fp32 register tile; one cross-lane reduction at the end. Latency is hidden by occupancy (several programs per
    SM, each with one 4-16 KB tile in flight).
  * DOT (any B <= 16): x is padded to 16 rows and the tile product is a tensor-core `tl.dot` of the weight tile
    [BLOCK_N, BLOCK_K] with x^T [BLOCK_K, 16] (swap-AB: the large dimension N is the MMA's M, so BLOCK_N = 64 maps
    onto Hopper's wgmma). The loads feed a dot, so Triton's software pipeliner keeps `num_stages` tiles in flight
    (cp.async into shared memory). fp32 (and mixed) inputs use an exact ("ieee") fp32 dot.
  * multi-row FMA (2 <= B <= 8, `kernels.gemv_rows`): the FMA loop for several rows: each weight tile is loaded once
    and multiplied by every row of x, B accumulators reduced over each 16-byte vector per step to keep registers
    bounded. B rows of FMA work instead of DOT's 16 (speculative verify steps: 4-5 rows at batch 1).
Grid: (cdiv(N, BLOCK_N),). No split-K: every Qwen projection has N >= 1024 rows.

The same kernel serves the fused gate/up + SwiGLU of `kernels.activation.fused_gate_up_silu` (GATED=True): each
program loads the gate rows n and the up rows I + n of the packed [2I, H] weight and writes silu(g) * u, with g and u
rounded to the activation dtype first exactly as the unfused GEMM + `silu_and_mul` sequence does.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from orinfer.kernels.gemv_rows import MAX_FMA_ROWS, gemv_epilogue, launch_gemv_rows, weight_tile
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl

MAX_ROWS = 16  # the DOT path pads x to 16 rows; larger batches go to cuBLAS


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b in x's dtype; in mixed mode (fp32 x, 16-bit W) the weight is widened first."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)


# torch float dtype -> Triton's, for kernels told a dtype as a constexpr (one they round to or store in).
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(t: torch.Tensor) -> None:
    if not t.is_cuda and not interpreting():
        raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors)")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as rows [M, K] with unit last stride (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, B, N, K, stride_xb, stride_wn, stride_ob, up_offset,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PDL: tl.constexpr):
    if PDL:  # see kernels/pdl.py: wait for the previous kernel before touching memory
        gdc_wait()
    offs_n, n_mask, offs_k, wg_ptrs, wu_ptrs = weight_tile(w_ptr, N, stride_wn, up_offset, BLOCK_N, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < B
    if USE_DOT:
        x_ptrs = x_ptr + offs_b[None, :] * stride_xb + offs_k[:, None]        # x^T tile [BLOCK_K, BLOCK_B]
        acc_g = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    else:
        x_ptrs = x_ptr + offs_k                                                 # row 0 of x [BLOCK_K]
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # Weights are streamed once: evict_first keeps them from pushing x (re-read by every program) out of L2.
        if EVEN_K:
            wg = tl.load(wg_ptrs, eviction_policy="evict_first")
            if GATED:
                wu = tl.load(wu_ptrs, eviction_policy="evict_first")
            if USE_DOT:
                xv = tl.load(x_ptrs, mask=b_mask[None, :], other=0.0)
            else:
                xv = tl.load(x_ptrs)
        else:
            k_mask = (k0 + offs_k) < K
            wg = tl.load(wg_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
            if GATED:
                wu = tl.load(wu_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
            if USE_DOT:
                xv = tl.load(x_ptrs, mask=k_mask[:, None] & b_mask[None, :], other=0.0)
            else:
                xv = tl.load(x_ptrs, mask=k_mask, other=0.0)
        if USE_DOT:
            if DOT_F32:
                xf = xv.to(tl.float32)
                acc_g = tl.dot(wg.to(tl.float32), xf, acc_g, input_precision="ieee")
                if GATED:
                    acc_u = tl.dot(wu.to(tl.float32), xf, acc_u, input_precision="ieee")
            else:
                xw = xv.to(wg.dtype)
                acc_g = tl.dot(wg, xw, acc_g)
                if GATED:
                    acc_u = tl.dot(wu, xw, acc_u)
        else:
            xf = xv.to(tl.float32)[None, :]
            acc_g += wg.to(tl.float32) * xf
            if GATED:
                acc_u += wu.to(tl.float32) * xf
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:  # the main loop is done: let the next kernel launch while this one reduces and stores
        gdc_launch_dependents()
    if USE_DOT:
        g = acc_g
        u = acc_u
    else:
        g = tl.sum(acc_g, axis=1)[:, None]
        u = tl.sum(acc_u, axis=1)[:, None]
    act_ty = x_ptr.dtype.element_ty  # the result rounds to x's dtype, whatever dtype it is stored in (out_dtype)
    if HAS_BIAS:
        g += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_b[None, :] * stride_ob + offs_n[:, None]
    gemv_epilogue(g, u, out_ptrs, n_mask[:, None] & b_mask[None, :], act_ty, GATED)


class GemvConfig(NamedTuple):
    use_dot: bool
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    multi_row: bool = False  # the multi-row FMA loop (kernels/gemv_rows.py; use_dot False, num_stages 1)


# "Use cuBLAS" (F.linear, then the silu_and_mul kernel when gated) is a candidate too, so the tuned choice is never
# slower than the library. Candidate lists are short: each config is compiled once and timed once per shape.
CUBLAS = GemvConfig(False, 0, 0, 0, 0)
# FMA: 72-77 registers (gated: 105-163) and no spills on sm_90 per ptxas; one tile of 4-16 KB in flight per
# program, several programs per SM.
FMA_CONFIGS = [GemvConfig(False, 8, 512, 4, 1), GemvConfig(False, 16, 512, 8, 1), GemvConfig(False, 4, 1024, 4, 1),
               GemvConfig(False, 16, 256, 4, 1), GemvConfig(False, 32, 256, 8, 1),
               # More bytes per iteration (and so more loads in flight per thread, the FMA loop is not pipelined):
               # these matter most for the small decode matrices (o, qkv) that cannot fill the chip otherwise.
               GemvConfig(False, 8, 1024, 4, 1), GemvConfig(False, 4, 2048, 4, 1), GemvConfig(False, 2, 4096, 4, 1),
               GemvConfig(False, 16, 1024, 8, 1), GemvConfig(False, 4, 512, 2, 1), GemvConfig(False, 8, 2048, 8, 1)]
# DOT: BLOCK_N = 64 (128) rows per warpgroup lets Triton use Hopper's wgmma (M=64, N=16); smaller BLOCK_N falls
# back to mma.sync with 160-255 registers and spills, so it is not offered. Shared memory: stages x (BLOCK_N +
# 16) x BLOCK_K x 2 bytes (twice the weight part when gated).
DOT_CONFIGS = [GemvConfig(True, 64, 128, 4, 3), GemvConfig(True, 64, 128, 4, 4), GemvConfig(True, 64, 64, 4, 6),
               GemvConfig(True, 64, 256, 4, 2), GemvConfig(True, 128, 64, 4, 4)]
# fp32 / mixed activations: the exact fp32 dot is an FMA loop; larger tiles spill (mixed gated above 64x32).
DOT_F32_CONFIGS = [GemvConfig(True, 64, 32, 4, 4), GemvConfig(True, 32, 32, 4, 4), GemvConfig(True, 32, 64, 4, 3),
                   GemvConfig(True, 16, 64, 4, 4)]
# One row (batch-1 decode): measured on the H200 (a sweep of graph replays over cold weights, see
# docs/performance.md), this config is within ~2% of the best on every Qwen3-8B shape and beats cuBLAS on all of them
# (qkv 84%, o 76%, fused gate_up 97%, down 92% of read bandwidth). Timing candidates in-process misleads here (small
# weights sit in L2 between repeats), so one row does not go through the tuner.
ONE_ROW = GemvConfig(False, 2, 2048, 2, 1)
# One row where ONE_ROW's tile does not fit (H200 sweeps, NOTES runs 323-324):
# - K < 2048 (Qwen3-0.6B, a draft model: hidden 1024): half of each 2048-wide tile is masked off; 8 x 512 with 4 warps
#   ran its lm_head in 74.7 us against 115.1 (98% of bandwidth against 63%) and qkv in 3.9 against 4.6 us.
# - the fused gate_up + SwiGLU (two tiles a program: 128 weights a thread at 2 x 2048): 60.1 us on Qwen3-8B's
#   2 x 12288 x 4096 against 50.9 at 8 x 512 (77% of bandwidth against 91-93%).
ONE_ROW_SMALL_TILE = GemvConfig(False, 8, 512, 4, 1)
# - K past 2048 but not a multiple of it (Qwen3.5-27B: hidden 5120, intermediate 17408): the last 2048-wide step is half
#   masked. The multi-row loop's 2 x 1024 tile with 2 warps, in whole steps, at one row (H200, NOTES run 377,
#   us ONE_ROW or ONE_ROW_SMALL_TILE / this): qkv 40.6 / 38.9, in_proj 45.0 / 41.5, down 48.3 / 44.9, the fused
#   gate_up + SwiGLU 90.8 / 85.6 (o and out_proj, K = 6144, keep ONE_ROW: 18.1 / 17.1 is within the sweep's noise).
ONE_ROW_WHOLE_STEPS = GemvConfig(False, 2, 1024, 2, 1, True)
DEFAULT_FMA = ONE_ROW
# 2..16 rows (batched decode), from the same sweep at 8 rows: best or within 3% on qkv/o/down (76-86% of bandwidth)
# and on the fused gate_up (96%), ahead of cuBLAS (61-84%) everywhere.
FEW_ROWS = GemvConfig(True, 64, 256, 4, 4)
# The fused gate_up + SwiGLU at 2..16 rows (`few_rows_gated`), from H200 sweeps at 2-8 rows on five Qwen shapes (NOTES
# run 378, `gemv-sweep-gated-rows-h200-run378.md`). 3 stages keep two programs on an SM: best where the grid of 64-row
# programs fills >= 70% of its last wave of 2 x SMs (Qwen3-8B: 192 programs, 53.1 us at 4 rows against 54.0 with 4
# stages); otherwise the tail wave idles and 4 stages, one program an SM, win at every row count measured (Qwen3.5-27B
# at 4 rows 101.4 against 118.6 us, Qwen2.5-7B 72.2 / 77.3, Qwen3-0.6B 5.8 / 6.5). At 2 rows the multi-row FMA loop
# beats the 3-stage tile on every shape and both DOT tiles on four of five (27B 87.4 us, 8B 52.8, 0.6B 5.5 against
# 107.9 / 53.5 / 5.9 for the better DOT; Qwen2.5-7B 75.6 against 71.9 with 4 stages).
FEW_ROWS_GATED = GemvConfig(True, 64, 128, 4, 3)
FEW_ROWS_GATED_DEEP = GemvConfig(True, 64, 128, 4, 4)
TWO_ROWS_GATED = ONE_ROW_WHOLE_STEPS  # the same multi-row 2 x 1024 tile, 2 warps
FULL_WAVE_FILL = 0.7
DEFAULT_DOT = GemvConfig(True, 64, 128, 4, 3)
DEFAULT_DOT_F32 = GemvConfig(True, 32, 32, 4, 4)
# Multi-row FMA (2..MAX_FMA_ROWS rows, kernels/gemv_rows.py), from sm_90 codegen (ptxas registers, loop instructions
# per weight; not yet timed). BLOCK_K is 256 or 512 per warp, so that x's slice needs no shared-memory exchange per
# step (16-bit x; fp32 x still takes one). Pairs such as (4, 512, 2) and (4, 1024, 4) compile to the same per-thread
# code (4 weight rows x 8 k) and differ in programs per SM. Non-gated, 8 rows: at most 168 registers, no spills.
ROWS_CONFIGS = [GemvConfig(False, bn, bk, w, 1, True) for bn, bk, w in
                [(2, 512, 2), (4, 512, 2), (8, 512, 2), (4, 1024, 4), (8, 1024, 4), (2, 1024, 2), (4, 1024, 2),
                 (2, 2048, 4), (4, 2048, 4)]]
# Gated holds two weight tiles and two accumulator sets: tiles of more than 32 weights a thread reach 255 registers
# at 4 rows and spill at 8, so only the narrower ones (at most 168 registers at 8 rows).
ROWS_CONFIGS_GATED = [GemvConfig(False, bn, bk, w, 1, True) for bn, bk, w in
                      [(2, 512, 2), (4, 512, 2), (4, 1024, 4), (2, 1024, 2), (2, 2048, 4)]]
# The fewest instructions per weight at 4-5 rows within ~128-168 registers: 4 rows 8.0 (128 registers), 8 rows 13.7
# (168); gated 4 x 1024: 4 rows 8.0 (109), 8 rows 13.7 (168). The one-row loop: 3.8.
FEW_ROWS_FMA = GemvConfig(False, 8, 1024, 4, 1, True)
FEW_ROWS_FMA_GATED = GemvConfig(False, 4, 1024, 4, 1, True)
# Which loop 2..16 rows of 16-bit x take (read once): "dot" (the measured default above), "fma" (FEW_ROWS_FMA* for
# 2..MAX_FMA_ROWS rows, DOT beyond), "tune" (the tuner times multi-row FMA, DOT and cuBLAS per shape and row bucket;
# in-process timing favours small weights that stay in L2, see ONE_ROW). For end-to-end A/B runs.
FEW_ROWS_LOOP = os.environ.get("ORINFER_GEMV_FEW_ROWS", "dot")


class _Tuner:
    """Picks a launch config per problem key by timing the candidates once, on CUDA, outside graph capture.

    Unlike `triton.autotune` it never benchmarks while a CUDA graph is being captured (it returns the cached choice,
    or the default when the shape was never seen): warm each decode batch size up eagerly before capturing.
    ORINFER_AUTOTUNE=0 disables timing (defaults only). `cache` maps key -> config, for reports.
    """

    def __init__(self) -> None:
        self.cache: dict[tuple, GemvConfig] = {}

    def pick(self, key: tuple, candidates: list[GemvConfig], default: GemvConfig, device: torch.device,
             launch: Callable[[GemvConfig], object]) -> GemvConfig:
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if (interpreting() or device.type != "cuda" or os.environ.get("ORINFER_AUTOTUNE", "1") == "0"
                or torch.cuda.is_current_stream_capturing()):
            return default
        timings = {}
        for cfg in candidates:
            try:
                timings[cfg] = triton.testing.do_bench(lambda: launch(cfg), warmup=5, rep=25)
            except Exception:  # a config that does not compile or fit (shared memory, registers) is skipped
                timings[cfg] = float("inf")
        best = min(timings, key=timings.get)
        if timings[best] == float("inf"):
            best = default
        self.cache[key] = best
        return best


TUNER = _Tuner()


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Dtype pairs the kernel handles: equal dtypes (fp32/fp16/bf16), or fp32 x with a 16-bit weight (mixed)."""
    float_types = (torch.float32, torch.float16, torch.bfloat16)
    if x.dtype not in float_types or weight.dtype not in float_types:
        return False
    return x.dtype == weight.dtype or x.dtype == torch.float32


def launch_gemv(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_out: int, gated: bool,
                cfg: GemvConfig, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Runs one explicit config on x2 [B, K] (unit last stride); returns [B, n_out] (a new tensor) in `out_dtype`
    (default x's dtype; the values are x's dtype's either way)."""
    if cfg == CUBLAS:
        y = gemv_ref(x2, weight, bias)
        if gated:
            from orinfer.kernels.activation import silu_and_mul  # lazy: activation imports this module
            y = silu_and_mul(y)
        return y if out_dtype is None else y.to(out_dtype)
    rows, k = x2.shape
    if cfg.multi_row:
        out = torch.empty(rows, n_out, dtype=out_dtype or x2.dtype, device=x2.device)
        launch_gemv_rows(x2, weight, bias, out, gated, cfg.block_n, cfg.block_k, cfg.num_warps, use_pdl(x2))
        return out
    if not cfg.use_dot and rows != 1:
        raise ValueError("the one-row FMA loop computes one row; use a DOT or multi-row config for several rows")
    out = torch.empty(rows, n_out, dtype=out_dtype or x2.dtype, device=x2.device)
    dot_f32 = x2.dtype == torch.float32 or weight.dtype == torch.float32 or interpreting()
    _gemv_kernel[(triton.cdiv(n_out, cfg.block_n),)](
        x2, weight, out if bias is None else bias, out, rows, n_out, k, x2.stride(0), weight.stride(0),
        out.stride(0), n_out if gated else 0,
        HAS_BIAS=bias is not None, GATED=gated, USE_DOT=cfg.use_dot, DOT_F32=dot_f32,
        BLOCK_B=16 if cfg.use_dot else 1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, PDL=use_pdl(x2), launch_pdl=use_pdl(x2))
    return out


def run_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
             cfg: GemvConfig | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Shared body of `gemv` and `fused_gate_up_silu`: validates, picks a config (timed once per shape), launches.

    The caller has checked `supported(x, weight)` and 1 <= rows <= MAX_ROWS. gated: weight is [2I, K] packed
    (gate rows first) and the result is silu(x Wg^T) * (x Wu^T) [B, I]. `cfg` forces a config (tests). `out_dtype`:
    see `gemv`.
    """
    check_device(x)
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("weight must be row-major (stride(1) == 1)")
    if gated and weight.shape[0] % 2:
        raise ValueError("a packed gate/up weight needs an even number of rows")
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    if bias is not None and (tuple(bias.shape) != (n_out,) or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n_out} outputs")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if cfg is None:
        cfg = fixed_config(rows, gated, x.dtype, weight.dtype, k, n_out, cuda_sm_count(x.device) or 0)
    if cfg is None:
        key = (n_out, k, rows_bucket(rows), gated, bias is not None, x.dtype, weight.dtype, out_dtype, str(x.device))
        candidates, default = tuning_plan(rows, gated, x.dtype, weight.dtype)
        cfg = TUNER.pick(key, candidates, default, x.device,
                         lambda c: launch_gemv(x2, weight, bias, n_out, gated, c, out_dtype))
    return launch_gemv(x2, weight, bias, n_out, gated, cfg, out_dtype).reshape(*lead, n_out)


def rows_bucket(rows: int) -> int:
    """The tuner's row key: 1, 2, 4, 8 or 16 (rows rounded up to a power of two), so that a shape is timed once per
    bucket, not once per row count (each timing compiles and runs every candidate)."""
    return triton.next_power_of_2(rows)


def few_rows_gated(rows: int, n: int | None = None, sms: int = 0) -> GemvConfig:
    """The fused gate_up + SwiGLU's config for 2..16 rows of 16-bit x (the measurements are at FEW_ROWS_GATED): the
    multi-row FMA loop at 2 rows, else the DOT tile whose residency suits the grid of the n outputs on `sms` SMs
    (n or sms unknown: FEW_ROWS_GATED)."""
    if rows == 2:
        return TWO_ROWS_GATED
    if n is None or not sms:
        return FEW_ROWS_GATED
    programs = triton.cdiv(n, FEW_ROWS_GATED.block_n)
    slots = 2 * sms  # two 3-stage programs fit an SM's shared memory, one 4-stage one
    fill = programs / (triton.cdiv(programs, slots) * slots)
    return FEW_ROWS_GATED if fill >= FULL_WAVE_FILL else FEW_ROWS_GATED_DEEP


@functools.lru_cache(maxsize=None)
def cuda_sm_count(device: torch.device) -> int | None:
    """The device's SM count, None off CUDA (each caller names its interpreter stand-in: `attention.num_sms`,
    `fp8_mm.sm_count`)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def fixed_config(rows: int, gated: bool, x_dtype: torch.dtype, w_dtype: torch.dtype,
                 k: int | None = None, n: int | None = None, sms: int = 0) -> GemvConfig | None:
    """The measured config for 16-bit x and W (one row, by `k` = x's columns when given; 2..16 rows per
    FEW_ROWS_LOOP; the gated ones by the outputs `n` and the device's SM count `sms` when given), or None: timed by
    the tuner."""
    if FEW_ROWS_LOOP not in ("dot", "fma", "tune"):
        raise ValueError(f"ORINFER_GEMV_FEW_ROWS must be dot, fma or tune, got {FEW_ROWS_LOOP!r}")
    if x_dtype != w_dtype or x_dtype == torch.float32:
        return None
    if rows == 1:
        return one_row_config(gated, k)
    if FEW_ROWS_LOOP == "fma" and rows <= MAX_FMA_ROWS:
        return FEW_ROWS_FMA_GATED if gated else FEW_ROWS_FMA
    if FEW_ROWS_LOOP == "tune":
        return None
    return few_rows_gated(rows, n, sms) if gated else FEW_ROWS


def one_row_config(gated: bool, k: int | None = None) -> GemvConfig:
    """The one-row config: ONE_ROW_WHOLE_STEPS for K past ONE_ROW's tile but not a multiple of it (in whole 1024-wide
    steps), else ONE_ROW, or ONE_ROW_SMALL_TILE for gated weights and for K shorter than ONE_ROW's tile."""
    if k is not None and k > ONE_ROW.block_k and k % ONE_ROW.block_k and k % ONE_ROW_WHOLE_STEPS.block_k == 0:
        return ONE_ROW_WHOLE_STEPS
    return ONE_ROW_SMALL_TILE if gated or (k is not None and k < ONE_ROW.block_k) else ONE_ROW


def tuning_plan(rows: int, gated: bool, x_dtype: torch.dtype, w_dtype: torch.dtype
                ) -> tuple[list[GemvConfig], GemvConfig]:
    """(candidates, default) for the tuner: the one-row FMA configs at one row, the multi-row FMA configs at
    2..MAX_FMA_ROWS, the DOT configs (fp32 ones for fp32 x) and, when x and W share a dtype, cuBLAS (in mixed mode it
    would widen the whole weight every call). The default serves where timing is impossible (CPU, graph capture)."""
    same = x_dtype == w_dtype
    f32 = x_dtype == torch.float32
    few = 2 <= rows <= MAX_FMA_ROWS
    multi_row = (ROWS_CONFIGS_GATED if gated else ROWS_CONFIGS) if few else []
    candidates = ((FMA_CONFIGS if rows == 1 else []) + multi_row
                  + (DOT_F32_CONFIGS if f32 else DOT_CONFIGS) + ([CUBLAS] if same else []))
    if rows == 1:
        default = one_row_config(gated)
    elif not f32:  # 16-bit x in "tune" mode: the measured tensor-core configs
        default = FEW_ROWS_GATED if gated else FEW_ROWS
    else:
        default = CUBLAS if same else DEFAULT_DOT_F32
    return candidates, default


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for x [..., K] with at most MAX_ROWS rows; more rows, or other dtype pairs, go to `gemv_ref`.
    y is rounded to x's dtype and returned in `out_dtype` (default x's): fp32 logits come out of the lm_head GEMV
    itself, with the values of `gemv_ref(...).float()`, instead of through a separate widening copy."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 0 or rows > MAX_ROWS or not supported(x, weight):
        y = gemv_ref(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)
    return run_gemv(x, weight, bias, gated=False, out_dtype=out_dtype)
