"""Token embedding and the language-model head (which may share the embedding matrix), and a head whose logits come
from a linear layer of any weight format (`LinearHead`: the FP8 drafter's quantized copy of a head).

Under tensor parallelism (orinfer/distributed) both are vocab-parallel: rank r holds rows [r * n, (r + 1) * n) of
the [V, H] matrix, n = ceil(V / world) (the last rank's tail is zero padding). The embedding looks up the ids in its
range, zeroes the others and sums over the ranks (one all-reduce of [T, H]); the head computes its [R, n] logits
and gathers the ranks' columns ([R, V] on every rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from orinfer.distributed.group import all_gather_columns, all_reduce, current
from orinfer.distributed.sharding import vocab_rows
from orinfer.layers.linear import LinearBase, copy_checked, default_weight_loader
from orinfer.layers.ops import Ops


class _VocabRows:
    """The rows of the vocabulary this rank holds."""

    def __init__(self, vocab_size: int) -> None:
        group = current()
        self.vocab_size, self.parallel = vocab_size, group.enabled
        self.num_rows = vocab_rows(vocab_size, group.world_size)
        self.first_row = group.rank * self.num_rows

    def loader(self):
        """The weight loader: the whole matrix, or (parallel) this rank's slice, which the last rank's padding
        makes shorter than its rows."""
        if not self.parallel:
            return default_weight_loader

        def load(param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
            real = min(self.num_rows, max(0, self.vocab_size - self.first_row))
            copy_checked(param.data[:real], loaded, name or "weight")
            param.data[real:].zero_()

        return load


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, act_dtype: torch.dtype, dtype: torch.dtype) -> None:
        super().__init__()
        self.act_dtype = act_dtype
        self.rows = _VocabRows(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows.num_rows, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.rows.loader()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.rows.parallel:
            return F.embedding(input_ids, self.weight).to(self.act_dtype)
        local = input_ids - self.rows.first_row
        inside = (local >= 0) & (local < self.rows.num_rows)
        rows = F.embedding(local.clamp(0, self.rows.num_rows - 1), self.weight) * inside.unsqueeze(-1)
        return all_reduce(rows).to(self.act_dtype)  # one rank's row and zeros: the sum is exact in any dtype


class LMHead(nn.Module):
    """logits = h W^T, computed in the activation dtype and returned as fp32 (as HF does)."""

    def __init__(self, vocab_size: int, hidden_size: int, ops: Ops, dtype: torch.dtype,
                 tied_to: Embedding | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.vocab_size = vocab_size
        self.rows = _VocabRows(vocab_size)
        if tied_to is not None:
            self.weight = tied_to.weight  # the same Parameter: one copy in memory, loaded once
        else:
            self.weight = nn.Parameter(torch.empty(self.rows.num_rows, hidden_size, dtype=dtype),
                                       requires_grad=False)
            self.weight.weight_loader = self.rows.loader()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.rows.parallel:
            return self.ops.lm_head(hidden, self.weight)
        return _all_columns(self.ops.lm_head(hidden, self.weight, widen=False), self.vocab_size)


class LinearHead(nn.Module):
    """LMHead's contract (fp32 logits [R, V], gathered over the ranks when vocab-parallel) through `linear`, a layer
    of any weight format over the same vocabulary rows (`linear_types.quantized_head` builds one from an LMHead). The
    logits are the linear's, in the activation dtype, widened."""

    def __init__(self, linear: LinearBase, rows: _VocabRows, vocab_size: int) -> None:
        super().__init__()
        self.linear, self.rows, self.vocab_size = linear, rows, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden)
        return _all_columns(logits, self.vocab_size) if self.rows.parallel else logits.float()


def _all_columns(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A vocab-parallel head's fp32 logits [R, V] from this rank's [R, n] in the activation dtype: the ranks' columns
    gathered in that dtype (half the bytes of fp32 for 16-bit models: 20 MB less a step at batch 64 on Qwen3's
    vocabulary), widened as they are put in order, padding cut."""
    logits = all_gather_columns(logits, out_dtype=torch.float32)
    return logits if logits.shape[1] == vocab_size else logits[:, :vocab_size].contiguous()
