"""The INT4 linear entry points of the triton backend: pick the W4 kernel for the row count.

  1 row                     -> `w4_gemv_int` for 16-bit x on the gate/up and long-row projections (integer dot
                               products, x rounded to 16 bits per 128 inputs), else `w4_gemv` (fp32 FMAs); both
                               CUDA cores, whole rows of W per program: decode at batch 1. x made into int16 words
                               by its RMSNorm (`kernels/w4_words.py`, qkv and gate/up) -> `w4_gemv_words`
  2..MMA_MAX_ROWS rows      -> `w4_mma`: 16- or 32-row tiles, split-K (decode batches; exact codes on tensor cores), for
                               group sizes that are multiples of 128 (AWQ's usual 128); smaller groups take the
                               prefill path below
  more (prefill)            -> `w4_dequantize` into a temporary 16-bit W [N, K], then cuBLAS: 3-4x faster than our
                               fused tensor-core tiles at 2048 rows (H200); the dequantisation costs about 2.5
                               bytes of traffic per weight, a few % of a prefill's time
fp32 x takes the same kernels (exact fp32 dots); other dtypes fall back to the torch references.
"""

from __future__ import annotations

import torch

import torch.nn.functional as F

from orinfer.kernels import w4_int_step
from orinfer.kernels.activation import silu_and_mul
from orinfer.kernels.w4 import W4Weight, w4_gate_up_silu_ref, w4_linear_ref
from orinfer.kernels.w4_gemv import w4_gemv, w4_gemv_int, w4_gemv_words
from orinfer.kernels.w4_mma import w4_dequantize, w4_mma
from orinfer.kernels.w4_words import W4Words

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
MMA_MAX_ROWS = 64   # at 48-64 rows, 32-row MMA tiles take half the time of dequantise + cuBLAS (H200)
FP16_MAX = 65504.0


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def _mma_fits(rows: int, w: W4Weight) -> bool:
    """Whether `w4_mma` takes these rows: a decode batch, and groups of whole 128-input chunks."""
    return rows <= MMA_MAX_ROWS and w.group_size % 128 == 0


def _one_row(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    if w4_int_step.takes(x, w, gated):
        return w4_gemv_int(x, w, bias, gated)
    return w4_gemv(x, w, bias, gated)


def w4_linear(x: torch.Tensor | W4Words, w: W4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) in x's dtype (`w4_linear_ref`'s contract); x may come as its words (`kernels/w4_words.py`)."""
    if isinstance(x, W4Words):
        return w4_gemv_words(x, w, bias)
    if x.dtype not in _FLOAT_TYPES:
        return w4_linear_ref(x, w, bias)
    rows = _rows(x)
    if rows == 1:
        return _one_row(x, w, bias, False)
    if _mma_fits(rows, w):
        return w4_mma(x, w, bias)
    return _dequant_matmul(x, w, bias)


def _dequant_matmul(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = F.linear(x, w4_dequantize(w, x.dtype), None if bias is None else bias.to(x.dtype))
    if x.dtype == torch.float16:
        y = y.clamp_(-FP16_MAX, FP16_MAX)  # the kernels' fp16 guard (cuBLAS already rounded overflow to inf)
    return y


def w4_gate_up_silu(x: torch.Tensor | W4Words, w: W4Weight) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) from a packed gate_up W4 weight (gate rows first), in one pass over the weight and
    without the [rows, 2I] intermediate (`w4_gate_up_silu_ref`'s contract); x may come as its words."""
    if isinstance(x, W4Words):
        return w4_gemv_words(x, w, gated=True)
    if x.dtype not in _FLOAT_TYPES:
        return w4_gate_up_silu_ref(x, w)
    if w.out_features % 16:
        raise ValueError(f"a packed gate/up weight needs out_features divisible by 16, got {w.out_features}")
    rows = _rows(x)
    if rows == 1:
        return _one_row(x, w, None, True)
    if _mma_fits(rows, w):
        return w4_mma(x, w, gated=True)
    return silu_and_mul(_dequant_matmul(x, w, None))
