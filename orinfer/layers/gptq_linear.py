"""GPTQ linear layers (symmetric, 4 or 8 bits, classic checkpoint format), dense and packed (q|k|v, gate|up).

Parameters, in the checkpoint's layout (orinfer/gptq_config.py): qweight int32 [K / P, N], qzeros int32 [groups, N / P],
scales fp16 [groups, N], g_idx int32 [K], optional bias [N] in the model's weight dtype; P = 32 / bits. Packed along
the output, qweight, qzeros and scales concatenate by columns (every shard's N is a multiple of P, so no word holds
two shards), while g_idx stays one row per shard ([S, K]): each checkpoint matrix has its own, and with act-order
they need not agree. Forward is `ops.gptq_linear` (the torch backend dequantises per call).

`finish_loading` repacks a layer whose shards share one act-order (as GPTQ gives q|k|v and gate|up, which read the
same input) into the layout its kernels read, exactly; x's columns are then permuted once per call when act-order is
on (one gather of the activations, kernels/w8.py explains why that is exact):
  - 4 bits, groups W4 can hold (16, 32, 64 or a multiple of 128 dividing K): the W4 layout (kernels/gptq_w4.py),
    qweight/qzeros/scales replaced by packed/w4_scales/w4_zeros, forward `ops.w4_linear` (the AWQ Triton kernels);
  - 8 bits, any group size: the W8 layout (kernels/w8.py), replaced by codes/w8_scales/w8_zeros (no w8_zeros but the
    int `w8_zero` when every zero point is the same, as symmetric GPTQ's 128), forward
    `ops.w8_linear` (the FP8 GEMV / MMA on uint8 codes for decode, dequantise + cuBLAS for prefill).
`checkpoint_tensors()` rebuilds the GPTQ tensors exactly.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from orinfer.errors import WeightsError
from orinfer.kernels.gptq import gptq_dequantize_ref
from orinfer.kernels.gptq_w4 import gptq_to_w4, w4_to_gptq
from orinfer.kernels.w4 import W4Weight
from orinfer.kernels.w8 import W8Weight, gptq_to_w8, w8_to_gptq
from orinfer.layers.linear import LinearBase, shard_offsets
from orinfer.layers.ops import Ops

GPTQ_PARAMS = ("qweight", "qzeros", "scales", "g_idx")
_INT_PARAMS = ("qweight", "qzeros", "g_idx")
W4_PARAMS = ("packed", "w4_scales", "w4_zeros")
W8_PARAMS = ("codes", "w8_scales", "w8_zeros")

log = logging.getLogger(__name__)


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
        self.register_buffer("input_perm", None, persistent=False)  # W4 / W8 with act-order: x's column order

    @property
    def shard_offsets(self) -> dict[object, tuple[int, int]] | None:
        """Packed layers: shard id -> (first output column, columns); a single matrix has none."""
        return None if list(self._shards) == [None] else self._shards

    def _shard_columns(self) -> tuple[tuple[int, int], ...] | None:
        return None if self.shard_offsets is None else tuple(self._shards.values())

    @property
    def repacked(self) -> bool:
        return "packed" in self._parameters or "codes" in self._parameters

    @property
    def w4(self) -> W4Weight:
        return W4Weight(self.packed, self.w4_scales, self.w4_zeros, self.group_size)

    @property
    def w8(self) -> W8Weight:
        zeros = self.w8_zeros if "w8_zeros" in self._parameters else self.w8_zero
        return W8Weight(self.codes, self.w8_scales, zeros, self.group_size)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """x in the repacked layout's input order (act-order: one gather of its columns)."""
        return x if self.input_perm is None else x.index_select(-1, self.input_perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "packed" in self._parameters:
            return self.ops.w4_linear(self._input(x), self.w4, self.bias)
        if "codes" in self._parameters:
            return self.ops.w8_linear(self._input(x), self.w8, self.bias)
        return self.ops.gptq_linear(x, self.qweight, self.qzeros, self.scales, self.g_idx, self.bits,
                                    self._shard_columns(), self.bias)

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        if "packed" in self._parameters:
            return self.ops.w4_gate_up_silu(self._input(x), self.w4)
        if "codes" in self._parameters and self.bias is None:
            return self.ops.w8_gate_up_silu(self._input(x), self.w8)
        return self.ops.silu_and_mul(self(x))

    def decode_weights(self) -> tuple[torch.Tensor, ...]:
        if "packed" in self._parameters:
            return self.packed, self.w4_scales, self.w4_zeros
        if "codes" in self._parameters:
            return self.codes, self.w8_scales, *([self.w8_zeros] if "w8_zeros" in self._parameters else [])
        return self.qweight, self.qzeros, self.scales

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Repacks into W4 (4 bits) or W8 (8 bits) when the layout can hold the layer (module docstring); others keep
        GPTQ's tensors."""
        if self.repacked:
            return
        g_idx = self.g_idx.view(-1, self.in_features)
        if any(not torch.equal(g_idx[0], row) for row in g_idx[1:]):
            log.debug("GPTQ shards with different act-orders: kept in GPTQ's layout")
            return
        repack, names = (gptq_to_w4, W4_PARAMS) if self.bits == 4 else (gptq_to_w8, W8_PARAMS)
        try:
            w, perm = repack(self.qweight, self.qzeros, self.scales, g_idx[0], self.group_size)
        except ValueError as exc:
            log.debug("GPTQ layer kept in GPTQ's layout: %s", exc)
            return
        for name in ("qweight", "qzeros", "scales"):
            del self._parameters[name]
        for name, tensor in zip(names, w[:3]):
            if isinstance(tensor, torch.Tensor):
                self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
            else:
                self.w8_zero = tensor       # one zero point for all (W8 of symmetric GPTQ)
        self.input_perm = perm

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
        if self.repacked:
            raise WeightsError(f"{name}: the layer was already repacked (load every tensor before finish_loading)")
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
        t = self.checkpoint_tensors()
        shards = self._shard_columns() or ((0, self.out_features),)
        g_idx = t["g_idx"].view(-1, self.in_features)
        p = 32 // self.bits
        return torch.cat([gptq_dequantize_ref(t["qweight"][:, c0:c0 + n], t["qzeros"][:, c0 // p:(c0 + n) // p],
                                              t["scales"][:, c0:c0 + n], g_idx[i], self.bits, dtype)
                          for i, (c0, n) in enumerate(shards)])

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """qweight, qzeros, scales, g_idx in GPTQ's layout (rebuilt from W4 / W8 once repacked), and bias if any."""
        if self.repacked:
            w4 = "packed" in self._parameters
            qweight, qzeros, scales = (w4_to_gptq(self.w4, self.input_perm) if w4
                                       else w8_to_gptq(self.w8, self.input_perm))
            out = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": self.g_idx.data}
        else:
            out = {name: getattr(self, name).data for name in GPTQ_PARAMS}
        if self.bias is not None:
            out["bias"] = self.bias.data
        return out
