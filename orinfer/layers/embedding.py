"""Token embedding and the language-model head (which may share the embedding matrix)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from orinfer.layers.linear import default_weight_loader
from orinfer.layers.ops import Ops


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, act_dtype: torch.dtype, dtype: torch.dtype) -> None:
        super().__init__()
        self.act_dtype = act_dtype
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight).to(self.act_dtype)


class LMHead(nn.Module):
    """logits = h W^T, computed in the activation dtype and returned as fp32 (as HF does)."""

    def __init__(self, vocab_size: int, hidden_size: int, ops: Ops, dtype: torch.dtype,
                 tied_to: Embedding | None = None) -> None:
        super().__init__()
        self.ops = ops
        if tied_to is not None:
            self.weight = tied_to.weight  # the same Parameter: one copy in memory, loaded once
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
            self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.lm_head(hidden, self.weight)
