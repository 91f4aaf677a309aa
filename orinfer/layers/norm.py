"""RMSNorm module; `forward(x, residual)` fuses the residual add when the backend can."""

from __future__ import annotations

import torch
from torch import nn

from orinfer.layers.linear import default_weight_loader
from orinfer.layers.ops import Ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        # The linear that reads this norm's output, when the backend wired it (layers/decode_hooks.py); in a list so
        # that it is not registered as a submodule.
        self.consumer: list[nn.Module] = []

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With it: (norm(x + residual), x + residual). A consumer that takes words
        (batch-1 AWQ decode) gets them instead of the normed row (`ops.rms_norm_words`)."""
        if self.consumer and self.ops.rms_norm_words is not None and self.consumer[0].takes_words(x):
            return self.ops.rms_norm_words(x, self.weight, self.eps, residual)
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
