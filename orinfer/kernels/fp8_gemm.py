"""FP8 block-wise W8A8 GEMM on FP8 tensor cores (prefill): x quantized per token and bk-wide group
(`kernels/fp8_quant.py`), the weight's block scales applied per K step, fp32 accumulation, 16-bit output.

Math: y [M, N] = sum_kb s_x[m, kb] * s_w[n / bn, kb] * (q_x[m, kb-block] . q_w[n, kb-block]) (+ b), rounded once to
the activation dtype (fp16 clamped to +-65504): exactly the fp32 product of the dequantised x and W
(`fp8_block_linear_a8_ref`) up to summation order. x is the MMA's M side (its per-row scales are 2 values a thread
in the wgmma accumulator layout; on the N side they would be 32), W^T [BLOCK_K, BLOCK_N] its N side; both operands
K-major in shared memory, as FP8 wgmma requires. Each K step of BLOCK_K (dividing bk) is one fresh `tl.dot` chain (4
m64nNk32 wgmmas, accumulated inside the tensor core, whose FP8 accumulation keeps ~14 mantissa bits) promoted into the
fp32 accumulator with its scales: one FFMA per accumulator element per step when the tile's rows share one weight scale
row (ROW_UNIFORM: BLOCK_N divides bn, Qwen's layers), the scale products precomputed per row.

Grid (tiles, SPLIT): tiles [BLOCK_M, BLOCK_N] in GROUP_M bands along M (consecutive programs share weight tiles in L2);
SPLIT > 1 splits K (`kernels/splitk.py`) for the few tiles of small M (the W8A8 alternative for decode batches).
Traffic: M*K (x, FP8) per BLOCK_N weight rows + N*K per BLOCK_M rows + M*N*2 out; at prefill sizes bound by the FP8 MMA
rate (989 TFLOP/s dense bf16 -> 1979 FP8 on an H100 SXM), the target ~1.3x+ the bf16 GEMM's time.

TMA (`Fp8GemmConfig.tma`, off in every default; candidates for decode batches, M <= 64): the same kernel (constexpr
TMA) with the x and W tiles fetched by the Tensor Memory Accelerator, the same dots in the same order (the tests check
the pointer path's result bit for bit at the same tile and split). At M = 64 the pointer path reads Qwen3-8B's FP8
weights at 23-62% of the HBM bandwidth (H200 run 363) with ~8 K steps a program after split-K, so each step's load
latency counts: there every thread computes clamped (masked, for a partial last K block) addresses and issues 8 16-byte
cp.async a step (64 x 64 tile: 8 KB of x + 8 KB of W), here one thread issues one bulk copy per operand (UTMALDG,
completion counted on an mbarrier), boxes past M, N or K read as zeros (no clamps, no masks, nothing stored from them),
the loop is the same length in SASS (129 instructions a step against 124, sm_90) on 92 registers against 122, and
deeper pipelines cost only shared memory (16 KB a stage at 64 x 64). Bytes moved are unchanged. The descriptors are
host-side (`triton.tools.tensor_descriptor.TensorDescriptor`): the launcher encodes each 128-byte CUtensorMap on the
host and passes it as a __grid_constant__ kernel parameter, which a CUDA graph captures by value like a pointer
argument: no device memory, no host sync, nothing built per program (the cost: encoding two descriptors per eager
launch on the CPU, none in a replayed graph). In-kernel `tl.make_tensor_descriptor` would need the process-wide
`triton.set_allocator` hook (called at every launch for grid x 128 bytes of scratch, from the graph's pool during
capture) and every program to write and fence its descriptors before its first load: latency on the short programs TMA
is meant to help. TMA needs a 16-byte aligned base and row stride (FP8: K % 16 == 0): otherwise the pointer path runs
(`_tma_operands`). A row_block only remaps the scale rows (pointer loads on both paths), so TMA takes it. Not built:
256-deep K steps. FP8 boxes are at most 128 wide in K (the 128-byte swizzle; Triton splits a wider box into copies of
128), so a 256 step would save loop overhead only; num_stages 4-8 already deepen the prefetch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from orinfer.kernels.fp8_block import FP8_DTYPE
from orinfer.kernels.fp8_gemv import _scale_rows, check_fp8_weight
from orinfer.kernels.fp8_mm import sm_count
from orinfer.kernels.gemv import check_device
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.splitk import counters, plan, splitk_store
from orinfer.kernels.tiles import grouped_tile, tile_rows


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, s_ptr, rb_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_am,
                     stride_as, stride_wn, stride_sn, stride_om, STEPS, BN: tl.constexpr, BK: tl.constexpr,
                     HAS_RB: tl.constexpr, ROW_UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP16: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, TMA: tl.constexpr):
    if PDL:  # kernels/pdl.py
        gdc_wait()
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m, offs_n, rm, rn = tile_rows(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    if not TMA:      # TMA: a_ptr and w_ptr are tensor descriptors of x [M, K] and W [N, K] (`_tma_operands`)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + offs_k[None, :]     # x [BLOCK_M, BLOCK_K]
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
        if TMA:      # boxes past M, N or K read as zeros: no clamped rows, no K mask
            a = a_ptr.load([pid_m * BLOCK_M, k0])
            w = w_ptr.load([pid_n * BLOCK_N, k0]).T
        elif EVEN_K:
            a = tl.load(a_ptrs + k0)
            w = tl.load(w_ptrs + k0)
        else:
            kmask = (k0 + offs_k) < K
            a = tl.load(a_ptrs + k0, mask=kmask[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=kmask[:, None], other=0.0)
        part = tl.dot(a, w)
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
    tma: bool = False    # x and W tiles through TMA descriptors where they can describe them (module docstring)

    def __repr__(self) -> str:
        """The fields, less `tma` when off: the config strings of the earlier sweep tables stay as they were."""
        text = ", ".join(f"{name}={value}" for name, value in zip(self._fields, self))
        return f"Fp8GemmConfig({text.removesuffix(', tma=False')})"


# Prefill: 128 x 128 tiles over two warpgroups (acc and the step's dot result 64 + 64 registers a thread, 165 in all;
# 128 x 256, or 128 x 128 on one warpgroup, spill), 32 KB of operands per stage, 4 stages. The loop is 153 SASS
# instructions a thread per K step, 64 of them the FFMAs that promote the step's dot (Triton waits for each wgmma
# before them, so they do not overlap the tensor cores; a one-step software pipeline in the source did not change
# that: Triton still waits at the end of the iteration). Candidates for `orinfer.bench.fp8_kernels --sweep`, the
# small-M ones for decode batches (`small_m_config`).
PREFILL = Fp8GemmConfig(128, 128, 128, 8, 4)
CANDIDATES = [Fp8GemmConfig(*c) for c in [(128, 128, 128, 8, 4), (128, 128, 128, 8, 3), (128, 64, 128, 4, 4),
                                          (64, 128, 128, 4, 4), (64, 128, 128, 4, 4, 0), (64, 64, 128, 4, 4, 0),
                                          (64, 32, 128, 4, 4, 0), (64, 64, 128, 4, 6, 0), (64, 64, 128, 4, 3, 0),
                                          (64, 64, 128, 4, 4, 2), (64, 32, 128, 4, 6, 0), (16, 64, 128, 4, 4, 0),
                                          (32, 64, 128, 4, 4, 0),
                                          (64, 64, 128, 4, 3, 0, True), (64, 64, 128, 4, 4, 0, True),
                                          (64, 64, 128, 4, 6, 0, True), (64, 32, 128, 4, 4, 0, True),
                                          (64, 128, 128, 4, 4, 0, True)]]

# Decode batches (2-64 rows), all split-K by plan. Per-layer us of Qwen3-8B's four GEMMs with the activation quantize,
# H200 run 365 (qkv + o + gate_up + down; torch._scaled_mm 98-116, bf16 cuBLAS 114-119 at every M):
#   M = 8:  16 x 64 tile 83.5; a 64-row tile 192 (its padding rows clamp onto the real ones; gate_up alone 113)
#   M = 32: 32 x 64 tile 98.3; 64 x 64 148
#   M = 64: 64-row TMA tiles, 64 columns where N gives >= 2 tiles an SM (gate_up 34.3 us against 46.1 at 32 columns),
#           else 32 (qkv 14.8, o 13.5, down 23.7 against 17.7, 21.4, 31.3): 86.3; one 64 x 64 pointer tile 98.0
# The 16- and 32-row tiles are below a warpgroup MMA (64 rows): Triton widens the FP8 tiles to f16 (exact) and runs
# mma.sync, which these memory-bound shapes do not notice.
SMALL_M_16 = Fp8GemmConfig(16, 64, 128, 4, 4, 0)
SMALL_M_32 = Fp8GemmConfig(32, 64, 128, 4, 4, 0)
SMALL_M_WIDE = Fp8GemmConfig(64, 64, 128, 4, 4, 0, True)
SMALL_M_NARROW = Fp8GemmConfig(64, 32, 128, 4, 4, 0, True)


def small_m_config(m: int, n: int, sms: int) -> Fp8GemmConfig:
    """The decode-batch tile for m <= 64 rows of x and n output columns on a GPU of `sms` SMs (table above)."""
    if m <= 16:
        return SMALL_M_16
    if m <= 32:
        return SMALL_M_32
    return SMALL_M_WIDE if triton.cdiv(n, 64) >= 2 * sms else SMALL_M_NARROW


def _tma_operands(xq: torch.Tensor, weight: torch.Tensor, m: int, n: int, k: int, block_m: int, block_n: int,
                  block_k: int) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """Host-side TMA descriptors of x [m, K] (rows past m, in xq's padding, read as zeros) and W [n, K] in boxes of
    [block_m, block_k] and [block_n, block_k]; None where TMA cannot address them: a base address or a row stride
    (FP8: bytes) that is not a multiple of 16 (K % 16 != 0, or a view at an odd offset). Module docstring: why
    host-side."""
    if any(t.data_ptr() % 16 or t.stride(0) % 16 for t in (xq, weight)):
        return None
    return (TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [block_m, block_k]),
            TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [block_n, block_k]))


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             block_size: tuple[int, int], out_dtype: torch.dtype, row_block: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, cfg: Fp8GemmConfig | None = None) -> torch.Tensor:
    """y [M, N] in out_dtype for xq [M(_pad), K] float8_e4m3fn and x_scale [M, Kb] fp32 with stride(0) == 1 (as
    `fp8_quantize_act` returns them, group = bk; rows of xq past x_scale's M are ignored). Needs bk % 32 == 0."""
    check_device(xq)
    m, kb = x_scale.shape
    k = xq.shape[-1]
    n = check_fp8_weight(weight, scale, block_size, row_block, k, bias)
    bn, bk = block_size
    if xq.dim() != 2 or xq.dtype != FP8_DTYPE or xq.shape[0] < m or xq.stride(1) != 1 or bk % 32:
        raise ValueError(f"fp8_gemm takes a row-major float8_e4m3fn x [>= {m}, K] and bk % 32 == 0, got "
                         f"{tuple(xq.shape)} {xq.dtype}, bk {bk}")
    if kb != -(-k // bk) or x_scale.stride(0) != 1 or x_scale.dtype != torch.float32:
        raise ValueError(f"x_scale must be an fp32 [{m}, {-(-k // bk)}] view with stride(0) == 1, got "
                         f"{tuple(x_scale.shape)} {tuple(x_scale.stride())} {x_scale.dtype}")
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype must be fp32, fp16 or bf16, got {out_dtype}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    sms = sm_count(xq.device)
    cfg = cfg or (PREFILL if m > 64 else small_m_config(m, n, sms))
    block_k = min(cfg.block_k, bk & -bk)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    steps = triton.cdiv(k, block_k)
    split, per_split = plan(tiles, steps, cfg.split_k, sms)
    ws = torch.empty(split, 1, m, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    pdl = use_pdl(xq)
    tma = _tma_operands(xq, weight, m, n, k, cfg.block_m, cfg.block_n, block_k) if cfg.tma else None
    a_arg, w_arg = tma or (xq, weight)
    _fp8_gemm_kernel[(tiles, split)](
        a_arg, x_scale, w_arg, scale, scale if row_block is None else row_block, out if bias is None else bias, out,
        ws,
        counters(xq.device) if split > 1 else scale, m, n, k, xq.stride(0), x_scale.stride(1), weight.stride(0),
        scale.stride(0), out.stride(0), per_split, BN=bn, BK=bk, HAS_RB=row_block is not None,
        ROW_UNIFORM=row_block is None and bn % cfg.block_n == 0, HAS_BIAS=bias is not None,
        CLAMP16=out_dtype == torch.float16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8,
        SPLIT=split, EVEN_K=tma is not None or k % block_k == 0, PDL=pdl, TMA=tma is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    return out
