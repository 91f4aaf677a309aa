"""Dynamic FP8 activation quantization per token and per group of G inputs (G = the weight's block width, 128 for
Qwen), as FP8 block-wise checkpoints declare it (`activation_scheme: "dynamic"`): the W8A8 GEMMs' x operand.

Math: for row m and group g (inputs gG .. gG + G - 1): s[m, g] = amax |x[m, group]| / 448 (an all-zero group: 1),
q[m, k] = e4m3(x[m, k] * (1 / s[m, g])) (fp32, IEEE-rounded reciprocal and product: one division per group, not per
element; clamped to +-448, rounded to nearest even). `fp8_block.fp8_quantize_act_ref` is the reference.

Layouts: q [M_pad, K] float8_e4m3fn row-major and s stored as [Kb, M_pad] fp32 (returned as its [M_pad, Kb]
transposed view, stride(0) == 1): a GEMM tile of rows reads its scales contiguously, and it is the layout
torch._scaled_mm's block-wise (1x128) scales take. M_pad = M rounded up to 4 (cuBLASLt wants 16-byte aligned scale
columns); padding rows are zeros with scale 1. The Triton GEMM takes the first M rows' views (`s[:M]`).

Kernel: grid (M_pad / 4, cdiv(Kb, GROUPS)); a program quantizes GROUPS groups (2048 inputs) of 4 rows: reads 16 KB
of bf16, writes 8 KB + 4 * 4 * GROUPS. Bandwidth-bound: Qwen3-8B's 2048 x 4096 prefill input is 16 MB read + 8 MB
written (~6 us on an H200).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.fp8_block import FP8_DTYPE
from orinfer.kernels.gemv import check_device


class Fp8Act(NamedTuple):
    """An activation x [..., K] already quantized for a W8A8 linear (`fp8_quantize_act`'s layout): what a producer
    (an RMSNorm, the SwiGLU; kernels/fp8_feed.py) hands an FP8 linear in place of x."""
    q: torch.Tensor            # [M_pad, K] float8_e4m3fn, rows past M zeros
    scale: torch.Tensor        # [M_pad, Kb] fp32 view of a [Kb, M_pad] tensor (stride(0) == 1), rows past M ones
    dtype: torch.dtype         # x's dtype: the linear's output dtype
    shape: tuple[int, ...]     # x's shape [..., K]: the linear's output is [..., N]

    @property
    def rows(self) -> int:
        """M, the rows of x (the GEMMs read scale[:M])."""
        return math.prod(self.shape[:-1])

    @property
    def device(self) -> torch.device:
        return self.q.device


@triton.jit
def quantize_groups(x):
    """(codes, s) of fp32 values x [ROWS, GROUPS, G]: s [ROWS, GROUPS] = amax / 448 (1 for an all-zero group), codes =
    x * (1 / s) clamped to +-448, still fp32 (the caller stores them as float8e4nv). Every FP8 activation producer
    quantizes through this, so their codes and scales are the same bits."""
    amax = tl.max(tl.abs(x), axis=2)
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = x * tl.math.div_rn(1.0, s)[:, :, None]        # IEEE reciprocal and product: the reference's values
    return tl.minimum(tl.maximum(q, -448.0), 448.0), s


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sg, G: tl.constexpr, ROWS: tl.constexpr,
                  GROUPS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    ks = g[:, None] * G + tl.arange(0, G)[None, :]                         # [GROUPS, G]
    r3 = rows.to(tl.int64)[:, None, None]
    # Padding rows (row >= M) read nothing: zeros, scale 1.
    mask = (ks < K)[None, :, :] & (r3 < M)
    x = tl.load(x_ptr + r3 * stride_xm + ks[None, :, :], mask=mask, other=0.0).to(tl.float32)
    q, s = quantize_groups(x)
    tl.store(q_ptr + r3 * stride_qm + ks[None, :, :], q.to(tl.float8e4nv), mask=(ks < K)[None, :, :])
    kb = tl.cdiv(K, G)
    tl.store(s_ptr + g.to(tl.int64)[None, :] * stride_sg + rows[:, None], s, mask=(g < kb)[None, :])


def act_buffers(m: int, k: int, group: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M_pad, K] float8_e4m3fn, s [Kb, M_pad] fp32) uninitialised: the buffers of an activation quantized in
    `group`-wide groups (module docstring; callers return s.t())."""
    m_pad = -(-m // 4) * 4
    return (torch.empty(m_pad, k, dtype=FP8_DTYPE, device=device),
            torch.empty(-(-k // group), m_pad, dtype=torch.float32, device=device))


def group_grid(m_pad: int, kb: int, group: int) -> tuple[tuple[int, int], int]:
    """((programs along rows, along groups), GROUPS) of a kernel quantizing 4 rows x GROUPS groups (2048 inputs) a
    program: `fp8_quantize_act`'s, and the SwiGLU producer's (kernels/fp8_feed.py)."""
    groups = max(1, min(2048 // group, triton.next_power_of_2(kb)))
    return (m_pad // 4, triton.cdiv(kb, groups)), groups


def check_group(group: int) -> None:
    if group < 16 or group & (group - 1):
        raise ValueError(f"the group size must be a power of two >= 16, got {group}")


def fp8_quantize_act(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M_pad, K] float8_e4m3fn, s: the [M_pad, Kb] fp32 view of a [Kb, M_pad] tensor) for x [M, K] 16/32-bit,
    M_pad = M rounded up to 4 (module docstring). `group` a power of two (Qwen: 128)."""
    check_device(x)
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fp8_quantize_act takes a 2-D fp32/fp16/bf16 x, got {tuple(x.shape)} {x.dtype}")
    check_group(group)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q, s = act_buffers(m, k, group, x.device)
    if m and k:
        grid, groups = group_grid(q.shape[0], s.shape[0], group)
        _quant_kernel[grid](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), G=group, ROWS=4, GROUPS=groups,
                            num_warps=4)
    return q, s.t()
