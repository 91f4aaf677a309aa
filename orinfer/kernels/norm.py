"""RMSNorm, optionally fused with the residual add that precedes it.

Math (per row of H features, fp32 inside): r' = x + r (rounded to the activation dtype, as the unfused model does),
y = w * (r' / sqrt(mean(r'^2) + eps)). Shapes: x, r [T, H]; w [H]. Returns y (and r' when a residual is given).
Traffic of a fused kernel: read x, r, w; write y, r' -> about 4*T*H elements, versus 6 for add + norm separately.
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch RMSNorm (+ residual add), matching HF's Qwen2RMSNorm rounding step for step."""
    if residual is not None:
        x = x + residual
        residual = x
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * y.to(x.dtype)
    if out.dtype != x.dtype:  # mixed mode: 16-bit weight, fp32 activations stay fp32
        out = out.to(x.dtype)
    return out if residual is None else (out, residual)
