"""RMSNorm module; `forward(x, residual)` fuses the residual add when the backend can."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from orinfer.layers.linear import default_weight_loader
from orinfer.layers.ops import Ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops, dtype: torch.dtype, zero_centered: bool = False) -> None:
        """zero_centered (Qwen3.5): the checkpoint stores w - 1 and the norm scales by (1 + w) in fp32; the weight is
        kept as 1 + w in fp32, so the ops see a plain RMSNorm whose fp32 weight multiplies before the cast."""
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32 if zero_centered else dtype),
                                   requires_grad=False)
        self.weight.weight_loader = _zero_centered_loader if zero_centered else default_weight_loader
        if zero_centered:
            self.weight.to_checkpoint = lambda value: (value - 1.0).to(dtype)
        # The linear that reads this norm's output, when the backend wired it (layers/decode_hooks.py); in a list so
        # that it is not registered as a submodule.
        self.consumer: list[nn.Module] = []
        # Work on x deferred into this norm (tensor parallelism: the all-reduce of a partial x, distributed/
        # norm_fold.py): fold(norm, x, residual) -> the outputs, or None after doing what the plain path needs.
        self.input_fold: Callable[[RMSNorm, torch.Tensor, torch.Tensor | None], Any] | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With it: (norm(x + residual), x + residual). A consumer that takes words
        (batch-1 AWQ decode) gets them instead of the normed row (`ops.rms_norm_words`), one that takes the row
        quantized for W8A8 (FP8 linears) an Fp8Act (`ops.rms_norm_fp8`). A fold (tensor parallelism) that normalises
        x itself returns the normed row: the FP8 consumer then quantizes it (the fold saves the launch feeding would)."""
        if self.input_fold is not None:
            folded = self.input_fold(self, x, residual)
            if folded is not None:
                return folded
        if self.feeds_words(x):
            return self.ops.rms_norm_words(x, self.weight, self.eps, residual)
        if self.consumer and self.ops.rms_norm_fp8 is not None and self.consumer[0].takes_fp8_act(x):
            return self.ops.rms_norm_fp8(x, self.weight, self.eps, residual, self.consumer[0].act_group)
        return self.ops.rms_norm(x, self.weight, self.eps, residual)

    def feeds_words(self, x: torch.Tensor) -> bool:
        """Whether the norm of x goes to its consumer as words (see forward)."""
        return bool(self.consumer) and self.ops.rms_norm_words is not None and self.consumer[0].takes_words(x)


def _zero_centered_loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
    default_weight_loader(param, loaded.float() + 1.0, shard, name)
