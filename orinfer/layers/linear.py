"""Linear layers, with packed variants that hold several checkpoint matrices in one weight.

`LinearBase` is what every weight format's linear offers models and backends (dense here; AWQ/W4 in awq_linear.py;
`linear_types.make_linear` picks the class): a model calls `linear(x)`, or `gate_up_silu(x)` on a packed gate/up
projection, and the layer dispatches to its format's kernels through the op table, fused variants included.

Packing q/k/v into one [q+2kv, H] matrix and gate/up into one [2I, H] matrix means one GEMM (one read of the input,
one launch) instead of three or two. Each parameter carries a `weight_loader(param, tensor, shard)` that copies one
checkpoint tensor into its slice and checks its shape, so the loader needs no knowledge of the packing.
"""

from __future__ import annotations

import torch
from torch import nn

from orinfer.errors import WeightsError
from orinfer.layers.ops import Ops


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """dst <- src (a slice of a packed parameter may be dst); WeightsError naming `what` if the shapes differ."""
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightsError(f"{what}: expected shape {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
    copy_checked(param.data, loaded, name or "weight")


class LinearBase(nn.Module):
    """The interface of a linear layer of any weight format. Subclasses set in_features / out_features, implement
    `forward`, `gate_up_silu` (when packed as gate | up), `decode_weights` and `checkpoint_tensors`."""

    in_features: int
    out_features: int

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x Wg^T) * (x Wu^T) for a layer packed as [gate | up] (shards 0 and 1): the MLP's first half."""
        raise NotImplementedError(f"{type(self).__name__} has no gate/up SwiGLU")

    def takes_words(self, x: torch.Tensor) -> bool:
        """Whether the norm producing x may hand this layer x's int16 words instead (`kernels/w4_words.py`)."""
        return False

    def takes_fp8_act(self, x: object) -> bool:
        """Whether x's producer may hand this layer x quantized for W8A8, an `Fp8Act` in groups of `act_group`
        (kernels/fp8_feed.py), instead of x: only x's rows, dtype and device count."""
        return False

    def decode_weights(self) -> tuple[torch.Tensor, ...]:
        """The tensors a decode-sized input streams from memory (what an L2 prefetch brings in)."""
        raise NotImplementedError

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The layer's tensors in the checkpoint layout, by kind ("weight", "bias", "qweight", ...), for saving."""
        raise NotImplementedError

    def shards_of(self, kind: str) -> tuple[object, ...] | None:
        """The shards (checkpoint matrices) that have a tensor of `kind`: all of a packed layer's by default (a
        layer mixing formats has, e.g., no scales for its 16-bit shards); None for a single matrix."""
        offsets = getattr(self, "shard_offsets", None)
        return None if offsets is None else tuple(offsets)


class Linear(LinearBase):
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

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gate_up_silu(x, self.weight)

    def decode_weights(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)  # the bias is too small to matter

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.weight.data}
        if self.bias is not None:
            out["bias"] = self.bias.data
        return out


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
        copy_checked(self.shard_view(param.data, shard, "weight"), loaded, name)

    def shard_view(self, tensor: torch.Tensor, shard: object, kind: str) -> torch.Tensor:
        """The rows of a weight or bias that hold `shard`."""
        offset, rows = self.shard_offsets[shard]
        return tensor.narrow(0, offset, rows)
