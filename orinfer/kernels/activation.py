"""SwiGLU activation on a packed gate/up projection.

Math: gate_up [T, 2I] = [g | u]; out [T, I] = silu(g) * u = g / (1 + exp(-g)) * u.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure-torch SwiGLU in the activation dtype (as HF computes it)."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
