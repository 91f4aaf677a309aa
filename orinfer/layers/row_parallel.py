"""The input columns of a row-parallel linear whose input every tensor-parallel rank holds whole.

A row-parallel linear y = x W^T splits W [out, in] along its input columns: rank r holds W[:, r*n:(r+1)*n] (n =
in / world) and multiplies the same columns of x, giving a partial sum that the model's plan all-reduces
(distributed/sharding.py: "rows" and "reduce_outputs"). Where x comes out of a column-parallel layer (o_proj, down)
each rank already holds just its columns; where every rank computes x whole (the MTP head's fc, whose input is two
normed vectors of the hidden width), `InputColumns` picks the rank's share.
"""

from __future__ import annotations

import torch

from orinfer.distributed.group import current
from orinfer.errors import ConfigError


class InputColumns:
    """Rank `rank`'s columns [first, first + width) of an input `in_features` wide (all of them on one rank)."""

    def __init__(self, in_features: int) -> None:
        group = current()
        if in_features % group.world_size:
            raise ConfigError(f"tensor_parallel_size {group.world_size} must divide a row-parallel layer's "
                              f"{in_features} input columns")
        self.width = in_features // group.world_size
        self.first = group.rank * self.width
        self.parallel = group.enabled

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, width]: this rank's columns (contiguous), or x itself on one rank."""
        if not self.parallel:
            return x
        return x[:, self.first:self.first + self.width].contiguous()
