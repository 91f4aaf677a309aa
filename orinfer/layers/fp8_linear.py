"""FP8 block-wise linear layers (W8A16), dense and packed (q|k|v, gate|up along the output).

Parameters, in the checkpoint's layout: `weight` float8_e4m3fn [N, K] and `weight_scale_inv` fp32 [rows, ceil(K/bk)]
(kernels/fp8_block.py has the math), optional `bias` [N] in the model's weight dtype. A packed layer stacks its shards'
scale rows: shard s of n_s outputs owns ceil(n_s / bn) of them, so a block never mixes two checkpoint matrices even
when n_s does not divide by bn (tiny models; Qwen's real shapes all divide by 128), and `row_block` [N] maps output
rows to scale rows. Forward is `ops.fp8_block_linear` (the torch backend dequantises per call; the triton backend's
kernels are chosen by row count in `kernels/fp8_ops.py`), a packed gate|up's `gate_up_silu` is `ops.fp8_gate_up_silu`
(decode rows: one pass over the weight with SwiGLU in the epilogue).

FP8 activation feeding (triton backend): where the dispatch would quantize x itself (W8A8), `takes_fp8_act` says so
and x's producer hands the layer an `Fp8Act` instead (the RMSNorm in front of qkv / gate_up, layers/norm.py); a
packed gate|up whose `consumer` (the down projection, wired by layers/decode_hooks.py) takes one returns its SwiGLU
quantized. Bit for bit what the layer would have made of x; ORINFER_FP8_FEED=0 turns it off (kernels/fp8_ops.py).

Mixed shards: a packed layer may keep its last shards 16-bit (`dense_shards`, from modules_to_not_convert: Qwen3.5's
in_proj_b / in_proj_a beside the FP8 in_proj_qkv / in_proj_z). Their rows live in `dense_weight` [rows, K] in the
model's dtype; the checkpoint's `<name>.weight` of such a shard loads there, it has no scale, and forward concatenates
the FP8 rows' output and theirs.

Online quantization (`FP8Config.online`, `--quantization fp8`): the checkpoint is 16/32-bit; `weight_loader`
quantizes each shard as it arrives (`fp8_block_quantize`, the same blocks a checkpoint would have), so no 16-bit
copy of the layer is ever held (a band of block rows is quantized at a time, so the fp32 temporaries stay small even
for a vocabulary-sized matrix). The scale is then a buffer, not a parameter: the loader does not expect it. Under
tensor parallelism each rank quantizes its own slice: the single process's blocks when the slice is whole blocks
(distributed/slices.py).
"""

from __future__ import annotations

import torch
from torch import nn

from orinfer.errors import ConfigError, WeightsError
from orinfer.fp8_config import check_activations_setting
from orinfer.kernels.fp8_block import FP8_DTYPE, fp8_block_dequantize_ref, fp8_block_quantize
from orinfer.kernels.fp8_quant import Fp8Act
from orinfer.layers.linear import LinearBase, shard_offsets
from orinfer.layers.ops import Ops


# Online quantization works through a shard in bands of whole block rows of about this many weights: its fp32
# temporaries (the widened band, its magnitudes, the per-weight scales, the quotient) then take ~1 GiB at most, where
# a whole 248320 x 5120 LM head (the FP8 drafter's copy, spec_decode/drafter.py) would take ~20 GB at once.
ONLINE_BAND_WEIGHTS = 1 << 26


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FP8Linear(LinearBase):
    """y = x W^T (+ b), W block-wise FP8. `shard_sizes` (packed layers) maps shard id -> output rows."""

    def __init__(self, in_features: int, shard_sizes: dict[object, int], bias: bool, ops: Ops, dtype: torch.dtype,
                 block_size: tuple[int, int], online: bool = False, dense_shards: tuple[object, ...] = ()) -> None:
        super().__init__()
        check_activations_setting()
        self.ops, self.block_size, self.online = ops, tuple(block_size), online
        self.in_features, self.out_features = in_features, sum(shard_sizes.values())
        order = list(shard_sizes)
        if dense_shards and order[len(order) - len(dense_shards):] != list(dense_shards):
            raise ConfigError(f"FP8: 16-bit shards {list(dense_shards)} of a packed layer must be its last ones "
                              f"(shards {order})")
        self.dense_shards = tuple(dense_shards)
        bn, bk = self.block_size
        self._shards = shard_offsets(shard_sizes)
        fp8_sizes = {s: rows for s, rows in shard_sizes.items() if s not in self.dense_shards}
        self.fp8_rows = sum(fp8_sizes.values())
        self._scale_rows = shard_offsets({s: _cdiv(rows, bn) for s, rows in fp8_sizes.items()})
        scale_rows = sum(rows for _, rows in self._scale_rows.values())
        self.weight = nn.Parameter(torch.empty(self.fp8_rows, in_features, dtype=FP8_DTYPE), requires_grad=False)
        scale = torch.ones(scale_rows, _cdiv(in_features, bk), dtype=torch.float32)
        if online:
            self.register_buffer("weight_scale_inv", scale)
        else:
            self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        dense_rows = self.out_features - self.fp8_rows
        self.dense_weight = nn.Parameter(torch.empty(dense_rows, in_features, dtype=dtype), requires_grad=False) \
            if dense_rows else None
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype), requires_grad=False) if bias else None
        # Output row -> scale row; None when it is n // bn (no shard boundary inside a block).
        aligned = all(self._shards[s][0] % bn == 0 for s in fp8_sizes)
        row_block = None if aligned else torch.cat([
            self._scale_rows[s][0] + torch.arange(rows, dtype=torch.int32) // bn for s, rows in fp8_sizes.items()])
        self.register_buffer("row_block", row_block, persistent=False)
        for prm in self.parameters():
            prm.weight_loader = self._load
        # The linear that reads this packed gate|up's SwiGLU, when the backend wired it (layers/decode_hooks.py); in a
        # list so that it is not registered as a submodule.
        self.consumer: list[LinearBase] = []

    @property
    def act_group(self) -> int:
        """The group width of the Fp8Act this layer takes (its weight blocks' width)."""
        return self.block_size[1]

    def takes_fp8_act(self, x: torch.Tensor | Fp8Act) -> bool:
        """Whether x (or any activation of its rows, dtype and device) may come as an Fp8Act: the backend feeds and
        its dispatch would quantize x for this layer (the W8A8 paths), and no 16-bit shard needs x itself."""
        takes = self.ops.fp8_takes_act
        return (takes is not None and self.dense_weight is None
                and takes(x, self.weight, self.weight_scale_inv, self.block_size, self.row_block))

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        n8 = self.fp8_rows
        bias = self.bias
        y = self.ops.fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block_size, self.row_block,
                                      None if bias is None else bias[:n8])
        if self.dense_weight is None:
            return y
        dense = self.ops.linear(x, self.dense_weight, None if bias is None else bias[n8:])
        return torch.cat([y, dense], dim=-1)

    def gate_up_silu(self, x: torch.Tensor | Fp8Act) -> torch.Tensor | Fp8Act:
        """SwiGLU of the packed gate|up; an Fp8Act for the consumer where it takes one and the SwiGLU runs alone."""
        if self.dense_weight is not None or self.bias is not None:
            return self.ops.silu_and_mul(self(x))
        args = (x, self.weight, self.weight_scale_inv, self.block_size, self.row_block)
        consumer = self.consumer[0] if self.consumer else None
        if consumer is not None and consumer.takes_fp8_act(x):    # its input has x's rows, dtype and device
            return self.ops.fp8_gate_up_silu(*args, act_group=consumer.act_group)
        return self.ops.fp8_gate_up_silu(*args)

    def decode_weights(self) -> tuple[torch.Tensor, ...]:
        dense = () if self.dense_weight is None else (self.dense_weight,)
        return (self.weight, self.weight_scale_inv, *dense)

    def shard_view(self, tensor: torch.Tensor, shard: object, kind: str) -> torch.Tensor:
        """The rows of `kind` (weight, weight_scale_inv or bias) that hold `shard`; a 16-bit shard's weight rows are
        in dense_weight whatever `tensor` is."""
        if kind == "weight_scale_inv":
            offset, rows = self._scale_rows[shard]
            return tensor.narrow(0, offset, rows)
        offset, rows = self._shards[shard]
        if kind == "weight" and shard in self.dense_shards:
            return self.dense_weight.data.narrow(0, offset - self.fp8_rows, rows)
        return tensor.narrow(0, offset, rows)

    def shards_of(self, kind: str) -> tuple[object, ...] | None:
        if self.shard_offsets is None:
            return None
        if kind == "weight_scale_inv":
            return tuple(self._scale_rows)
        return () if kind == "dense_weight" else tuple(self._shards)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
        if shard not in self._shards:
            raise WeightsError(f"{name}: unknown shard {shard!r} of a packed layer")
        kind = next(n for n, p in self._parameters.items() if p is param)
        if kind == "weight" and shard in self.dense_shards:
            if loaded.dtype == FP8_DTYPE or not loaded.is_floating_point():
                raise WeightsError(f"{name}: expected 16/32-bit weights (quantization_config's modules_to_not_convert "
                                   f"lists it), checkpoint has {loaded.dtype}")
        elif kind == "weight" and loaded.dtype != FP8_DTYPE:
            if not (self.online and loaded.is_floating_point()):
                raise WeightsError(f"{name}: expected float8_e4m3fn (quantization_config says FP8), checkpoint has "
                                   f"{loaded.dtype}")
            self._quantize(loaded, shard, name)
            return
        elif kind == "weight_scale_inv" and loaded.dtype != torch.float32:
            raise WeightsError(f"{name}: expected float32 block scales, checkpoint has {loaded.dtype}")
        _copy(self.shard_view(param.data, shard, kind), loaded, name)

    def _quantize(self, loaded: torch.Tensor, shard: object, name: str) -> None:
        """Online quantization of a 16/32-bit shard into its FP8 rows and block scales, a band of whole block rows at
        a time (ONLINE_BAND_WEIGHTS): blocks are quantized independently, so the result is the whole shard's."""
        weight = self.shard_view(self.weight.data, shard, "weight")
        scale = self.shard_view(self.weight_scale_inv.data, shard, "weight_scale_inv")
        if tuple(weight.shape) != tuple(loaded.shape):
            raise WeightsError(f"{name}: expected shape {tuple(weight.shape)}, checkpoint has {tuple(loaded.shape)}")
        bn = self.block_size[0]
        band = bn * max(1, ONLINE_BAND_WEIGHTS // max(1, bn * loaded.shape[1]))
        for first in range(0, loaded.shape[0], band):
            q, s = fp8_block_quantize(loaded[first:first + band], self.block_size)
            weight[first:first + band].copy_(q)
            scale[first // bn:first // bn + s.shape[0]].copy_(s)

    @property
    def shard_offsets(self) -> dict[object, tuple[int, int]] | None:
        """Packed layers: shard id -> (first output row, rows); a single matrix has none."""
        return None if list(self._shards) == [None] else self._shards

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] as a dense matrix (for checks)."""
        w = fp8_block_dequantize_ref(self.weight, self.weight_scale_inv, self.block_size, self.row_block, dtype)
        return w if self.dense_weight is None else torch.cat([w, self.dense_weight.to(dtype)])

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.weight.data, "weight_scale_inv": self.weight_scale_inv.data}
        if self.bias is not None:
            out["bias"] = self.bias.data
        return out


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightsError(f"{what}: expected shape {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    dst.copy_(src)
