"""AWQ INT4 linear layers (W4A16), dense and packed (q/k/v, gate/up), holding the checkpoint's tensors as they are.

Per linear with K inputs and N outputs (group size G): qweight [K, N/8] int32, qzeros [K/G, N/8] int32, scales
[K/G, N] fp16 (kept fp16 whatever the activation dtype: the kernels widen them to fp32), optional bias [N] in the
model's weight dtype. Packing is per 8 output columns, so shards concatenate along the output dimension: q|k|v and
gate|up become one [K, (q+2kv)/8] (one [K, 2I/8]) qweight whose columns keep every shard's own packing; each shard's
N must be a multiple of 8. `weight_loader(param, tensor, shard, name)` copies one checkpoint tensor into its column
slice, checking the shape, exactly as `layers.linear` does for dense weights.
"""

from __future__ import annotations

import torch
from torch import nn

from orinfer.errors import ConfigError, WeightsError
from orinfer.layers.linear import default_weight_loader, shard_offsets
from orinfer.layers.ops import Ops

QUANT_PARAMS = ("qweight", "qzeros", "scales")


def _check(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightsError(f"{what}: expected shape {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    if what.endswith(("qweight", "qzeros")) and src.dtype != torch.int32:
        raise WeightsError(f"{what}: expected int32 (packed 4-bit), checkpoint has {src.dtype}")
    dst.copy_(src)


def _awq_loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
    _check(param.data, loaded, name or "awq tensor")


class AWQLinear(nn.Module):
    """y = x W^T (+ b) with W stored as AWQ INT4; forward is `ops.awq_linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: Ops, dtype: torch.dtype,
                 group_size: int) -> None:
        super().__init__()
        group = in_features if group_size == -1 else group_size
        if group <= 0 or in_features % group:
            raise ConfigError(f"AWQ group_size {group_size} does not divide in_features {in_features}")
        if out_features % 8:
            raise ConfigError(f"AWQ needs out_features divisible by 8, got {out_features}")
        self.ops = ops
        self.in_features, self.out_features, self.group_size = in_features, out_features, group
        groups = in_features // group
        self.qweight = nn.Parameter(torch.empty(in_features, out_features // 8, dtype=torch.int32),
                                    requires_grad=False)
        self.qzeros = nn.Parameter(torch.empty(groups, out_features // 8, dtype=torch.int32), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(groups, out_features, dtype=torch.float16), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        for p in self.parameters():
            p.weight_loader = _awq_loader
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops.awq_linear is None:
            raise ConfigError(f"backend {self.ops.name!r} has no AWQ linear")
        return self.ops.awq_linear(x, self.qweight, self.qzeros, self.scales, self.group_size, self.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] as a dense matrix (for checks and exports)."""
        from orinfer.kernels.awq import awq_dequantize_ref

        return awq_dequantize_ref(self.qweight, self.qzeros, self.scales, self.group_size, dtype).t()


class AWQPackedLinear(AWQLinear):
    """Several AWQ checkpoint linears concatenated along the output. `shard_sizes` maps shard id -> out_features."""

    def __init__(self, in_features: int, shard_sizes: dict[object, int], bias: bool, ops: Ops, dtype: torch.dtype,
                 group_size: int) -> None:
        for shard, cols in shard_sizes.items():
            if cols % 8:
                raise ConfigError(f"AWQ shard {shard!r} has out_features {cols}, not a multiple of 8")
        super().__init__(in_features, sum(shard_sizes.values()), bias, ops, dtype, group_size)
        self.shard_offsets = shard_offsets(shard_sizes)
        for p in self.parameters():
            p.weight_loader = self._load_shard

    def shard_view(self, param: torch.Tensor, shard: object) -> torch.Tensor:
        """The slice of `param` (qweight, qzeros, scales or bias) that holds `shard`."""
        offset, cols = self.shard_offsets[shard]
        if param is self.bias:
            return param.data.narrow(0, offset, cols)
        if param is self.scales:
            return param.data.narrow(1, offset, cols)
        return param.data.narrow(1, offset // 8, cols // 8)  # qweight, qzeros: 8 columns per int32

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
        if shard not in self.shard_offsets:
            raise WeightsError(f"{name}: unknown shard {shard!r} of a packed layer")
        _check(self.shard_view(param, shard), loaded, name)
