"""Linear layers, with packed variants that hold several checkpoint matrices in one weight.

Packing q/k/v into one [q+2kv, H] matrix and gate/up into one [2I, H] matrix means one GEMM (one read of the input,
one launch) instead of three or two. Each parameter carries a `weight_loader(param, tensor, shard)` that copies one
checkpoint tensor into its slice and checks its shape, so the loader needs no knowledge of the packing.
"""

from __future__ import annotations

import torch
from torch import nn

from orinfer.errors import WeightsError
from orinfer.layers.ops import Ops


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightsError(f"{what}: expected shape {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
    _copy_checked(param.data, loaded, name or "weight")


class Linear(nn.Module):
    """y = x W^T (+ b). weight [out, in] as in the checkpoint."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops = ops
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        for p in self.parameters():
            p.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)

    def decode_weights(self) -> tuple[torch.Tensor, ...]:
        """The tensors a decode-sized input streams from memory (the bias is too small to matter)."""
        return (self.weight,)


def shard_offsets(shard_sizes: dict[object, int]) -> dict[object, tuple[int, int]]:
    """shard id -> (first output row, rows) for matrices stacked in `shard_sizes` order."""
    offsets: dict[object, tuple[int, int]] = {}
    offset = 0
    for shard, rows in shard_sizes.items():
        offsets[shard] = (offset, rows)
        offset += rows
    return offsets


class PackedLinear(Linear):
    """Several checkpoint matrices stacked along the output dimension. `shard_sizes` maps shard id -> rows."""

    def __init__(self, in_features: int, shard_sizes: dict[object, int], bias: bool, ops: Ops,
                 dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, ops, dtype)
        self.shard_offsets = shard_offsets(shard_sizes)
        for p in self.parameters():
            p.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
        if shard not in self.shard_offsets:
            raise WeightsError(f"{name}: unknown shard {shard!r} of a packed layer")
        offset, rows = self.shard_offsets[shard]
        _copy_checked(param.data.narrow(0, offset, rows), loaded, name)
