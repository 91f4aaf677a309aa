"""Routed experts in FP8 block-wise (the experts of Qwen3-30B-A3B-FP8 and the Qwen3.5/3.6 MoE FP8 releases).

Parameters (kernels/moe_fp8.py has the math): w13 float8_e4m3fn [E, 2I, H] and w2 [E, H, I], packed as the 16-bit
experts; w13_scale_inv fp32 [E, 2 ceil(I/bn), ceil(H/bk)] and w2_scale_inv [E, ceil(H/bn), ceil(I/bk)]. Checkpoints
store each expert's matrix with its own blocks (`experts.{e}.gate_proj.weight` e4m3 [I, H] and `.weight_scale_inv`
[ceil(I/bn), ceil(H/bk)], up_proj, down_proj alike); each lands in its slice: gate's scale rows first, up's after
them, so a block never mixes gate and up rows. Forward is `ops.fused_moe_fp8` (the torch backend dequantises the
chosen experts; the triton backend's expert kernels read e4m3 and apply the scales in-kernel).

Online quantization (`FP8Config.online`, `--quantization fp8`): the checkpoint's 16/32-bit expert matrices are
quantized one by one as they arrive (`fp8_block_quantize`, the blocks an FP8 checkpoint of them would have); the
scales are then buffers, which the loader does not expect.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from orinfer.errors import WeightsError
from orinfer.kernels.fp8_block import FP8_DTYPE, fp8_block_quantize
from orinfer.kernels.moe_fp8 import dequantize_experts, expert_scale_shapes
from orinfer.layers.linear import copy_checked
from orinfer.layers.moe import ExpertWeights
from orinfer.layers.ops import Ops


class FP8ExpertWeights(ExpertWeights):
    """`ExpertWeights` with e4m3 weights and fp32 block scales of `block_size` (bn, bk)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, ops: Ops, block_size: tuple[int, int],
                 online: bool = False, shared_slot: bool = False) -> None:
        super().__init__(num_experts, hidden, intermediate, ops, FP8_DTYPE, shared_slot)
        self.block_size, self.online = tuple(block_size), online
        for kind, shape in zip(("w13_scale_inv", "w2_scale_inv"),
                               expert_scale_shapes(self.num_experts, hidden, intermediate, self.block_size)):
            scale = torch.ones(shape, dtype=torch.float32)
            if online:
                self.register_buffer(kind, scale)
            else:
                setattr(self, kind, nn.Parameter(scale, requires_grad=False))
                getattr(self, kind).weight_loader = self._load_shard

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.fused_moe_fp8(x, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, self.block_size,
                                      topk_weights, topk_ids)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
        kind = self._kind(param, shard, name)
        dst = self.shard_view(param.data, str(shard))
        if kind.endswith("_scale_inv"):
            if loaded.dtype != torch.float32:
                raise WeightsError(f"{name}: expected float32 block scales, checkpoint has {loaded.dtype}")
        elif loaded.dtype != FP8_DTYPE:
            if not (self.online and loaded.is_floating_point()):
                raise WeightsError(f"{name}: expected float8_e4m3fn (quantization_config says FP8), checkpoint has "
                                   f"{loaded.dtype}")
            if tuple(loaded.shape) != tuple(dst.shape):   # checked before quantizing: the scales' shape follows it
                copy_checked(dst, loaded, name)
            loaded, scale = fp8_block_quantize(loaded, self.block_size)
            copy_checked(self.shard_view(getattr(self, f"{kind}_scale_inv"), str(shard)), scale, name)
        copy_checked(dst, loaded, name)

    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each expert matrix's `weight` and `weight_scale_inv`, as the FP8 releases name them."""
        for kind in ("w13", "w2"):
            scales = getattr(self, f"{kind}_scale_inv")
            for shard in self.shards_of(kind):
                yield f"{shard}.weight", self.shard_view(getattr(self, kind).data, shard)
                yield f"{shard}.weight_scale_inv", self.shard_view(scales, shard)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as dense [E, 2I, H] and [E, H, I] tensors (for checks)."""
        return (dequantize_experts(self.w13, self.w13_scale_inv, self.block_size, True, dtype),
                dequantize_experts(self.w2, self.w2_scale_inv, self.block_size, False, dtype))
