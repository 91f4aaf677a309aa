"""Block-wise FP8 (e4m3) weights: quantization, dequantization and the W8A16 linear, pure torch (the references).

A weight W [N, K] in blocks of [bn, bk] (Qwen: 128 x 128; edge blocks partial when N or K do not divide) is stored as
q = e4m3(W / s) [N, K] with one fp32 s per block, s = amax(|W| over the block) / 448 (e4m3's largest finite value;
an all-zero block gets s = 1), so W ~ q * s. Checkpoints call the [ceil(N / bn), ceil(K / bk)] tensor of s
`weight_scale_inv`.

Several matrices packed along N (q|k|v, gate|up) keep each one's own block rows: a block never straddles two of
them, so the scale rows of a packed weight are the shards' rows stacked, and `row_block` [N] (int) maps each output
row to its scale row. None means the plain layout, row n -> n // bn.

Activations (W8A8, prefill): quantized dynamically per token and per group of bk inputs with the same rule
(`fp8_quantize_act_ref`; the kernel is `kernels/fp8_quant.py`); `fp8_block_linear_a8_ref` is the product they define.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP16_MAX = 65504.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_block_quantize(w: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] float8_e4m3fn, s [ceil(N/bn), ceil(K/bk)] fp32) with W ~ q * s per block (module docstring). The
    division W / s is done in fp32, then rounded to nearest e4m3 (clamped to +-448 first: W / s can exceed it by an
    ulp of rounding)."""
    if w.dim() != 2:
        raise ValueError(f"fp8_block_quantize takes a 2-D weight, got shape {tuple(w.shape)}")
    bn, bk = block_size
    n, k = w.shape
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    w32 = w.float()
    padded = F.pad(w32.abs(), (0, kb * bk - k, 0, nb * bn - n))  # zeros do not change a block's amax
    amax = padded.view(nb, bn, kb, bk).amax(dim=(1, 3))
    # A tensor divisor: the same rounding on every device (see fp8_quantize_act_ref).
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (w32 / expand_block_scales(scale, (n, k), block_size)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def expand_block_scales(scale: torch.Tensor, shape: tuple[int, int], block_size: tuple[int, int],
                        row_block: torch.Tensor | None = None) -> torch.Tensor:
    """The per-element scale [N, K] fp32 of a weight of `shape` (each block's s repeated over its elements)."""
    n, k = shape
    bn, bk = block_size
    rows = torch.arange(n, device=scale.device) // bn if row_block is None else row_block.long()
    return scale.float()[rows].repeat_interleave(bk, dim=1)[:, :k]


def fp8_block_dequantize_ref(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                             row_block: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
                             ) -> torch.Tensor:
    """W [N, K] = q * s in fp32 (exact for the e4m3 values; one fp32 rounding of the product), then cast to dtype."""
    n, k = weight.shape
    bn, bk = block_size
    rows = scale.shape[0] if row_block is not None else _cdiv(n, bn)
    if scale.shape != (rows, _cdiv(k, bk)) or (row_block is not None and row_block.shape != (n,)):
        raise ValueError(f"scales {tuple(scale.shape)} do not fit a weight {tuple(weight.shape)} in blocks "
                         f"{block_size}")
    if row_block is None and n % bn == 0 and k % bk == 0:
        # Whole blocks (Qwen's real shapes): scale a block view in place, one fp32 temporary instead of three.
        w = weight.float().view(n // bn, bn, k // bk, bk).mul_(scale.float().view(n // bn, 1, k // bk, 1))
        return w.view(n, k).to(dtype)
    return (weight.float() * expand_block_scales(scale, (n, k), block_size, row_block)).to(dtype)


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                         row_block: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) in x's dtype with W dequantised per call (`fp8_block_dequantize_ref`, rounded once to x's
    dtype): weight-only FP8 (W8A16); activations are not quantized. fp16 results are clamped (`fp16_guard`)."""
    w = fp8_block_dequantize_ref(weight, scale, block_size, row_block, x.dtype)
    return fp16_guard(F.linear(x, w, None if bias is None else bias.to(x.dtype)))


def fp8_gate_up_silu_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                         row_block: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) for a packed FP8 gate_up weight [2I, K] (gate rows first): `fp8_block_linear_ref`, then
    SwiGLU in x's dtype (as `activation.silu_and_mul_ref`)."""
    y = fp8_block_linear_ref(x, weight, scale, block_size, row_block)
    inter = y.shape[-1] // 2
    return F.silu(y[..., :inter]) * y[..., inter:]


def fp16_guard(y: torch.Tensor) -> torch.Tensor:
    """fp16 results clamped to +-65504 (Qwen's activations can overflow fp16: "!!!!" outputs), as the W4 kernels
    do; other dtypes unchanged."""
    return y.clamp_(-FP16_MAX, FP16_MAX) if y.dtype == torch.float16 else y


def fp8_quantize_act_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] float8_e4m3fn, s [M, ceil(K / group)] fp32) for x [M, K]: per row and group of `group` inputs,
    s = amax / 448 (an all-zero group: 1) and q = e4m3(x * (1 / s)) (fp32, clamped to +-448): the weights' scales on
    [1, group] blocks, with the kernel's one reciprocal per group instead of a division per element."""
    m, k = x.shape
    kb = _cdiv(k, group)
    xf = F.pad(x.float(), (0, kb * group - k)).view(m, kb, group)
    amax = xf.abs().amax(dim=2)
    # A tensor divisor: torch divides by a Python scalar on CUDA as a product with its reciprocal, which rounds
    # differently from the kernel's IEEE division (run 292).
    s = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (xf * (1.0 / s)[:, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, kb * group)[:, :k]
    return q.contiguous(), s


def fp8_block_linear_a8_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                            row_block: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: y = x' W^T (+ b) in x's dtype, x' = x quantized per token and bk-wide group (`fp8_quantize_act_ref`) and
    dequantised, both factors in fp32 (the FP8 GEMM's exact product up to summation order); fp16 clamped."""
    lead, k = x.shape[:-1], x.shape[-1]
    q, s = fp8_quantize_act_ref(x.reshape(-1, k), block_size[1])
    xd = q.float() * s.repeat_interleave(block_size[1], dim=1)[:, :k]
    y = F.linear(xd, fp8_block_dequantize_ref(weight, scale, block_size, row_block, torch.float32))
    if bias is not None:
        y += bias.float()
    return fp16_guard(y.to(x.dtype)).reshape(*lead, -1)
