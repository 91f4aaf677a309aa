"""Rotary position embedding (RoPE, "rotate half" layout as in Qwen/LLaMA) with an optional per-head RMSNorm first
(Qwen3's q_norm / k_norm).

Math: for head vector x of size D split into halves (x1, x2) and angle theta_i = pos * base^(-2i/D):
  out = (x1*cos - x2*sin, x2*cos + x1*sin). Shapes: q [T, Hq*D], k [T, Hk*D], positions [T] int,
  cos_sin [max_pos, D] fp32 (cos in the first D/2 columns, sin in the last D/2).
"""

from __future__ import annotations

import torch

from orinfer.kernels.norm import rms_norm_ref


def rope_cos_sin_cache(head_dim: int, max_position: int, base: float, device: torch.device | None = None
                       ) -> torch.Tensor:
    """fp32 table [max_position, head_dim]: cos of the D/2 frequencies, then their sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    t = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                     head_dim: int, q_norm_weight: torch.Tensor | None = None,
                     k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (when weights are given) then RoPE, on flattened [T, heads*D] q and k; returns new tensors."""
    tokens = q.shape[0]
    qh = q.reshape(tokens, -1, head_dim)
    kh = k.reshape(tokens, -1, head_dim)
    if q_norm_weight is not None:
        qh = rms_norm_ref(qh, q_norm_weight, eps)
        kh = rms_norm_ref(kh, k_norm_weight, eps)
    table = cos_sin[positions.long()]
    half = head_dim // 2
    cos = table[:, None, :half].to(q.dtype)
    sin = table[:, None, half:].to(q.dtype)
    # HF concatenates (freqs, freqs) so cos/sin cover the full head; the two halves share angles, hence the repeat.
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    qh = _rotate_full(qh, cos, sin)
    kh = _rotate_full(kh, cos, sin)
    return qh.reshape(tokens, -1), kh.reshape(tokens, -1)


def _rotate_full(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
