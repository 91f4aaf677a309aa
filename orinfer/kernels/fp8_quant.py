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

import torch
import triton
import triton.language as tl

from orinfer.kernels.fp8_block import FP8_DTYPE
from orinfer.kernels.gemv import check_device


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
    amax = tl.max(tl.abs(x), axis=2)                                       # [ROWS, GROUPS]
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = x * tl.math.div_rn(1.0, s)[:, :, None]        # IEEE reciprocal and product: the reference's values
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(q_ptr + r3 * stride_qm + ks[None, :, :], q.to(tl.float8e4nv), mask=(ks < K)[None, :, :])
    kb = tl.cdiv(K, G)
    tl.store(s_ptr + g.to(tl.int64)[None, :] * stride_sg + rows[:, None], s, mask=(g < kb)[None, :])


def fp8_quantize_act(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M_pad, K] float8_e4m3fn, s: the [M_pad, Kb] fp32 view of a [Kb, M_pad] tensor) for x [M, K] 16/32-bit,
    M_pad = M rounded up to 4 (module docstring). `group` a power of two (Qwen: 128)."""
    check_device(x)
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fp8_quantize_act takes a 2-D fp32/fp16/bf16 x, got {tuple(x.shape)} {x.dtype}")
    if group < 16 or group & (group - 1):
        raise ValueError(f"the group size must be a power of two >= 16, got {group}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    m_pad = -(-m // 4) * 4
    kb = -(-k // group)
    q = torch.empty(m_pad, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(kb, m_pad, dtype=torch.float32, device=x.device)
    if m_pad and k:
        groups = max(1, min(2048 // group, triton.next_power_of_2(kb)))   # 4 rows x 2048 inputs a program
        _quant_kernel[(m_pad // 4, triton.cdiv(kb, groups))](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), G=group, ROWS=4, GROUPS=groups, num_warps=4)
    return q, s.t()
