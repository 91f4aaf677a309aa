"""The W8 (GPTQ-Int8, `kernels/w8.py`) linear entry points of the triton backend: the kernel for the row count of x.

  1 row                  -> `fp8_gemv` on uint8 codes (CUDA cores, every byte read once and turned into q - z in
                            registers: decode at batch 1)
  2..MMA_MAX_ROWS rows   -> `fp8_mm` on uint8 codes (W8A16 on tensor cores, split-K: decode batches, verify steps)
  more (prefill)         -> the weight dequantised to x's dtype (`fp8_dequantize` with zero points: 1 byte read and
                            2 written per weight, a few % of a 2048-token prefill), then cuBLAS; PREFILL = "mma"
                            (ORINFER_W8_PREFILL, read at import): `fp8_mm` on the codes with 128-row tiles instead
                            (no bf16 copy of the weight; for measuring against the dequantise path, run 328: 0.42x
                            bf16 at 512 tokens)
Both kernels are the FP8 ones with CODES = UINT8: the scales and zero points are per (output row, group), i.e. FP8
blocks of [1, group_size]. They need groups of a multiple of 16 inputs (a 16-input chunk lies in one group; GPTQ's
32..128 and whole rows of Qwen's shapes all are); other group sizes take the prefill path at every row count, and x in
dtypes other than fp32 / fp16 / bf16 the reference. Results are rounded once from fp32 sums (fp16 clamped), no host
syncs, one launch per call (decode): CUDA-graph safe.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from orinfer.kernels.activation import silu_and_mul
from orinfer.kernels.fp8_block import fp16_guard
from orinfer.kernels.fp8_dequant import fp8_dequantize
from orinfer.kernels.fp8_gemv import VEC, fp8_gemv
from orinfer.kernels.fp8_mm import DECODE_128, fp8_mm
from orinfer.kernels.w8 import W8Weight, w8_gate_up_silu_ref, w8_linear_ref

MMA_MAX_ROWS = 64   # as FP8's W8A16 tensor-core kernel: the same weight bytes per row of x
PREFILL = os.environ.get("ORINFER_W8_PREFILL", "dequant")   # dequant | mma
_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def _decode_kernel(x: torch.Tensor, w: W8Weight):
    """The kernel for x's rows (fp8_gemv or fp8_mm), or None: the dequantise + cuBLAS path."""
    rows = _rows(x)
    if PREFILL not in ("dequant", "mma"):
        raise ValueError(f"ORINFER_W8_PREFILL must be dequant or mma, got {PREFILL!r}")
    if x.dtype not in _FLOAT_TYPES or w.group_size % VEC or rows < 1:
        return None
    if rows > MMA_MAX_ROWS:
        return functools.partial(fp8_mm, cfg=DECODE_128) if PREFILL == "mma" else None
    return fp8_gemv if rows == 1 else fp8_mm


def w8_dequantize(w: W8Weight, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` (`w8_dequantize_ref(w, dtype)` bit for bit), one Triton kernel."""
    return fp8_dequantize(w.codes, w.scales, (1, w.group_size), None, dtype, zeros=w.zeros)


def w8_linear(x: torch.Tensor, w: W8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) in x's dtype (`w8_linear_ref`'s contract; decode kernels do not round W to x's dtype)."""
    if x.dtype not in _FLOAT_TYPES or _rows(x) == 0:
        return w8_linear_ref(x, w, bias)
    kernel = _decode_kernel(x, w)
    if kernel is not None:
        return kernel(x, w.codes, w.scales, (1, w.group_size), None, bias, zeros=w.zeros)
    y = F.linear(x, w8_dequantize(w, x.dtype), None if bias is None else bias.to(x.dtype))
    return fp16_guard(y)


def w8_gate_up_silu(x: torch.Tensor, w: W8Weight) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) from a packed gate_up W8 weight (gate rows first): decode rows in one pass over the
    weight with SwiGLU in the epilogue (`w8_gate_up_silu_ref`'s contract); prefill: the linear, then `silu_and_mul`."""
    if x.dtype not in _FLOAT_TYPES or _rows(x) == 0:
        return w8_gate_up_silu_ref(x, w)
    kernel = _decode_kernel(x, w)
    if kernel is not None:
        return kernel(x, w.codes, w.scales, (1, w.group_size), None, gated=True, zeros=w.zeros)
    return silu_and_mul(w8_linear(x, w))


def unfused_w8_gate_up_silu(x: torch.Tensor, w: W8Weight) -> torch.Tensor:
    """`w8_gate_up_silu` as two kernels: the W8 linear, then `silu_and_mul` (`--no-fused-ffn`)."""
    return silu_and_mul(w8_linear(x, w))
