"""The AWQ INT4 checkpoint format (AutoAWQ "gemm", as in HF AWQ checkpoints) and its pure-torch references.

For a linear with K inputs, N outputs and group size G:
  qweight [K, N/8] int32   eight 4-bit weights per int32, in AWQ's interleaved order: nibble p (bits 4p..4p+3) of
                           qweight[k, j] holds output column 8j + AWQ_PACK_ORDER[p], AWQ_PACK_ORDER = 0,2,4,6,1,3,5,7;
                           equivalently column 8j + c sits in nibble AWQ_UNPACK_ORDER[c] = 0,4,1,5,2,6,3,7.
  qzeros  [K/G, N/8] int32 4-bit zero points, packed the same way
  scales  [K/G, N]   fp16  one scale per group and output column
Math: W^T[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]; y [B, N] = x [B, K] W^T (+ b). Products and sums are fp32,
the result is rounded once to x's dtype. fp16 activations: the fp32 result is clamped to +-65504 before the cast
(Qwen3 activations can leave fp16's range; a clamp keeps the next RMSNorm finite instead of producing inf/NaN).

This layout is what checkpoints hold and what `orinfer quantize` / `orinfer export` write. The GPU kernels run on
orinfer's own in-memory layout instead (`kernels.w4`: rows of W along K, repacked once at load), because a decode GEMV
over [K, N/8] reads 4-16 byte pieces per row and reached only 12-22% of the read bandwidth
(docs/performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)    # nibble p holds column 8j + AWQ_PACK_ORDER[p]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8j + c is in nibble AWQ_UNPACK_ORDER[c]
FP16_MAX = 65504.0


# --- references ----------------------------------------------------------------------------------------------------

def awq_shapes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
               ) -> tuple[int, int, int]:
    """(K, N, G) of an AWQ linear after checking every shape and dtype; ValueError naming the mismatch."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [in, out/8], got shape {tuple(qweight.shape)}")
    k, n8 = qweight.shape
    g = k if group_size == -1 else int(group_size)
    if g <= 0 or k % g:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    if tuple(qzeros.shape) != (k // g, n8):
        raise ValueError(f"qzeros {tuple(qzeros.shape)} should be {(k // g, n8)} for qweight {tuple(qweight.shape)}")
    if tuple(scales.shape) != (k // g, 8 * n8):
        raise ValueError(f"scales {tuple(scales.shape)} should be {(k // g, 8 * n8)} for qweight "
                         f"{tuple(qweight.shape)}")
    return k, 8 * n8, g


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [R, 8C] int32 values 0..15 in column order (undoes AWQ's nibble interleave)."""
    shifts = torch.tensor([4 * p for p in AWQ_UNPACK_ORDER], dtype=torch.int32, device=packed.device)
    values = (packed.to(torch.int32)[..., None] >> shifts) & 0xF
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def awq_dequantize_ref(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """W^T [K, N] = (q - z) * s in `dtype` (default: the scales' dtype); computed in fp32 (fp64 if asked)."""
    _, _, g = awq_shapes(qweight, qzeros, scales, group_size)
    out_dtype = dtype or scales.dtype
    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    q = awq_unpack(qweight).to(compute)
    z = awq_unpack(qzeros).to(compute).repeat_interleave(g, dim=0)
    s = scales.to(compute).repeat_interleave(g, dim=0)
    return ((q - z) * s).to(out_dtype)


def _clamp_cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float16:
        y = y.clamp(-FP16_MAX, FP16_MAX)
    return y.to(dtype)


def awq_linear_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b): dequantise, multiply in fp32 (fp64 for fp64 x), round once to x's dtype (fp16: clamped)."""
    k, n, _ = awq_shapes(qweight, qzeros, scales, group_size)
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match in_features {k}")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = awq_dequantize_ref(qweight, qzeros, scales, group_size, dtype=compute)
    y = x.reshape(-1, k).to(compute) @ w
    if bias is not None:
        y = y + bias.to(compute)
    return _clamp_cast(y, x.dtype).reshape(*x.shape[:-1], n)


def awq_fused_gate_up_silu_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                               group_size: int) -> torch.Tensor:
    """silu(g) * u for the packed gate_up weight (gate columns first), rounding as GEMM + `silu_and_mul_ref` does
    (g, u and silu(g) rounded to x's dtype; the product of two 16-bit values is exact in fp32, then rounded)."""
    gu = awq_linear_ref(x, qweight, qzeros, scales, group_size)
    inter = gu.shape[-1] // 2
    g, u = gu[..., :inter], gu[..., inter:]
    if x.dtype in (torch.float16, torch.bfloat16):
        return _clamp_cast(F.silu(g).float() * u.float(), x.dtype)
    return F.silu(g) * u
