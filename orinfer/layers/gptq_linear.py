"""GPTQ linear layers (symmetric, 4 or 8 bits, classic checkpoint format), dense and packed (q|k|v, gate|up).

Parameters, in the checkpoint's layout (orinfer/gptq_config.py): qweight int32 [K / P, N], qzeros int32 [groups, N / P],
scales fp16 [groups, N], g_idx int32 [K], optional bias [N] in the model's weight dtype; P = 32 / bits. Packed along
the output, qweight, qzeros and scales concatenate by columns (every shard's N is a multiple of P, so no word holds
two shards), while g_idx stays one row per shard ([S, K]): each checkpoint matrix has its own, and with act-order
they need not agree. Forward is `ops.gptq_linear` (the torch backend dequantises per call).
"""

from __future__ import annotations

import torch
from torch import nn

from orinfer.errors import WeightsError
from orinfer.kernels.gptq import gptq_dequantize_ref
from orinfer.layers.linear import LinearBase, shard_offsets
from orinfer.layers.ops import Ops

GPTQ_PARAMS = ("qweight", "qzeros", "scales", "g_idx")
_INT_PARAMS = ("qweight", "qzeros", "g_idx")


class GPTQLinear(LinearBase):
    """y = x W^T (+ b), W in GPTQ's packed integers. `shard_sizes` maps shard id -> output columns (None: one)."""

    def __init__(self, in_features: int, shard_sizes: dict[object, int], bias: bool, ops: Ops, dtype: torch.dtype,
                 bits: int, group_size: int) -> None:
        super().__init__()
        self.ops, self.bits = ops, bits
        self.in_features, self.out_features = in_features, sum(shard_sizes.values())
        self.group_size = in_features if group_size == -1 else group_size
        p = 32 // bits
        for shard, cols in shard_sizes.items():
            if cols % p or in_features % p:
                raise WeightsError(f"GPTQ {bits}-bit needs in/out features divisible by {p}; shard {shard!r} is "
                                   f"{in_features} x {cols}")
        self._shards = shard_offsets(shard_sizes)
        groups = -(-in_features // self.group_size)
        n = self.out_features

        def param(shape: tuple[int, ...], dtype_: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype_), requires_grad=False)

        self.qweight = param((in_features // p, n), torch.int32)
        self.qzeros = param((groups, n // p), torch.int32)
        self.scales = param((groups, n), torch.float16)
        packed = self.shard_offsets is not None
        self.g_idx = param((len(shard_sizes), in_features) if packed else (in_features,), torch.int32)
        self.bias = param((n,), dtype) if bias else None
        for prm in self.parameters():
            prm.weight_loader = self._load

    @property
    def shard_offsets(self) -> dict[object, tuple[int, int]] | None:
        """Packed layers: shard id -> (first output column, columns); a single matrix has none."""
        return None if list(self._shards) == [None] else self._shards

    def _shard_columns(self) -> tuple[tuple[int, int], ...] | None:
        return None if self.shard_offsets is None else tuple(self._shards.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gptq_linear(x, self.qweight, self.qzeros, self.scales, self.g_idx, self.bits,
                                    self._shard_columns(), self.bias)

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(self(x))

    def decode_weights(self) -> tuple[torch.Tensor, ...]:
        return self.qweight, self.qzeros, self.scales

    def shard_view(self, tensor: torch.Tensor, shard: object, kind: str) -> torch.Tensor:
        """The part of a tensor of `kind` that holds `shard`."""
        offset, cols = self._shards[shard]
        if kind == "bias":
            return tensor.narrow(0, offset, cols)
        if kind == "g_idx":
            return tensor if self.shard_offsets is None else tensor[list(self._shards).index(shard)]
        if kind == "qzeros":
            p = 32 // self.bits
            return tensor.narrow(1, offset // p, cols // p)
        return tensor.narrow(1, offset, cols)  # qweight, scales

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
        if shard not in self._shards:
            raise WeightsError(f"{name}: unknown shard {shard!r} of a packed layer")
        kind = next(n for n, p in self._parameters.items() if p is param)
        dst = self.shard_view(param.data, shard, kind)
        if tuple(dst.shape) != tuple(loaded.shape):
            raise WeightsError(f"{name}: expected shape {tuple(dst.shape)}, checkpoint has {tuple(loaded.shape)}")
        if kind in _INT_PARAMS and loaded.dtype != torch.int32:
            raise WeightsError(f"{name}: expected int32 (packed GPTQ), checkpoint has {loaded.dtype}")
        if kind == "g_idx":
            groups = self.scales.shape[0]
            if loaded.numel() and (int(loaded.min()) < 0 or int(loaded.max()) >= groups):
                raise WeightsError(f"{name}: group indices must lie in 0..{groups - 1}")
        dst.copy_(loaded)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] as a dense matrix (for checks)."""
        shards = self._shard_columns() or ((0, self.out_features),)
        g_idx = self.g_idx.view(-1, self.in_features)
        p = 32 // self.bits
        return torch.cat([gptq_dequantize_ref(self.qweight[:, c0:c0 + n], self.qzeros[:, c0 // p:(c0 + n) // p],
                                              self.scales[:, c0:c0 + n], g_idx[i], self.bits, dtype)
                          for i, (c0, n) in enumerate(shards)])

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {name: getattr(self, name).data for name in GPTQ_PARAMS}
        if self.bias is not None:
            out["bias"] = self.bias.data
        return out
