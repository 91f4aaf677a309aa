"""AWQ INT4 linear layers (W4A16), dense and packed (q/k/v, gate/up): loaded in the checkpoint's layout, then
repacked once into orinfer's W4 layout (`kernels.w4`), which is what the kernels read.

Loading: per linear with K inputs and N outputs (group size G) the parameters are the checkpoint's qweight [K, N/8]
int32, qzeros [K/G, N/8] int32, scales [K/G, N] fp16, optional bias [N] in the model's weight dtype. Packing is per 8
output columns, so shards concatenate along the output dimension: q|k|v and gate|up become one [K, (q+2kv)/8]
(one [K, 2I/8]) qweight whose columns keep every shard's own packing; each shard's N must be a multiple of 8.
`weight_loader(param, tensor, shard, name)` copies one checkpoint tensor into its column slice, checking the shape,
exactly as `layers.linear` does for dense weights.

After loading, `finish_loading()` (called by the loaders) replaces those three parameters by the W4 ones: packed
[N, K/8] int32, w4_scales [N, K/G] fp16, w4_zeros [N, K/G] uint8 (same bytes, 0.52 per weight at G = 128), built in
slices of output columns so the transient memory stays ~100 MB. `checkpoint_tensors()` gives the AWQ tensors back.

Pre-dequantisation (`pre_dequant=True`, `--pre-dequant`: the seed's V6 mode, "memory for prefill speed"): after the
weights are loaded, `pre_dequantize_model` gives every AWQ linear a dense copy W [out, in] in the activation dtype,
exactly `awq_dequantize` of its packed tensors (`awq_dequantize_ref` off CUDA). Inputs of more than PRE_DEQUANT_ROWS
rows (prefill) then run F.linear on that copy (cuBLAS), fewer rows (decode) keep the INT4 kernels. The copy costs
2 bytes per weight in bf16/fp16 (4 in fp32) on top of the ~0.52 of the packed tensors.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from orinfer.errors import ConfigError, WeightsError
from orinfer.kernels.w4 import W4Weight, check_group_size, repack_awq, w4_dequantize_ref, w4_to_awq
from orinfer.kernels.w4_words import W4Words, words_fit
from orinfer.layers.linear import LinearBase, default_weight_loader, shard_offsets
from orinfer.layers.ops import Ops

QUANT_PARAMS = ("qweight", "qzeros", "scales")
W4_PARAMS = ("packed", "w4_scales", "w4_zeros")
REPACK_COLUMNS = 1024  # output columns repacked at a time (bounds the int64 temporaries to ~100 MB)
PRE_DEQUANT_ROWS = 16  # with a dense copy, inputs of more rows than this use it (the AWQ kernels' MAX_GEMV_ROWS)
FP16_MAX = 65504.0

log = logging.getLogger(__name__)


def _check(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightsError(f"{what}: expected shape {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    if what.endswith(("qweight", "qzeros")) and src.dtype != torch.int32:
        raise WeightsError(f"{what}: expected int32 (packed 4-bit), checkpoint has {src.dtype}")
    dst.copy_(src)


def _awq_loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
    _check(param.data, loaded, name or "awq tensor")


class AWQLinear(LinearBase):
    """y = x W^T (+ b) with W stored as INT4; forward is `ops.w4_linear` over the W4 layout."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: Ops, dtype: torch.dtype,
                 group_size: int) -> None:
        super().__init__()
        try:
            group = check_group_size(in_features, group_size)
        except ValueError as exc:
            raise ConfigError(f"AWQ: {exc}") from None
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
        # The pre-dequantised W [out, in] (`pre_dequantize`); a buffer, not a parameter: it is no checkpoint tensor.
        self.register_buffer("dense_weight", None, persistent=False)

    def uses_dense(self, x: torch.Tensor | W4Words) -> bool:
        """Whether `x` goes through the pre-dequantised copy: one exists in x's dtype and x has more than
        PRE_DEQUANT_ROWS rows (prefill); decode-sized inputs (and words) keep the INT4 kernels."""
        w = self.dense_weight
        return (w is not None and not isinstance(x, W4Words) and w.dtype == x.dtype
                and x.numel() > PRE_DEQUANT_ROWS * max(x.shape[-1], 1))

    def takes_words(self, x: torch.Tensor) -> bool:
        """Whether x's producer may hand this layer x's int16 words instead of x (`kernels/w4_words.py`): one row of
        16-bit activations for a group size of 128 or a multiple (the producer's backend decides whether it can)."""
        return words_fit(x, self.group_size)

    def forward(self, x: torch.Tensor | W4Words) -> torch.Tensor:
        if self.uses_dense(x):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            y = F.linear(x, self.dense_weight, bias)
            if x.dtype == torch.float16:
                y = y.clamp_(-FP16_MAX, FP16_MAX)  # the AWQ kernels' fp16 guard (Qwen3 activations overflow fp16)
            return y
        return self.ops.w4_linear(x, self.w4, self.bias)

    def gate_up_silu(self, x: torch.Tensor | W4Words) -> torch.Tensor:
        if self.uses_dense(x):  # --pre-dequant: prefill through the 16-bit copy
            return self.ops.silu_and_mul(self(x))
        return self.ops.w4_gate_up_silu(x, self.w4)

    def decode_weights(self) -> tuple[torch.Tensor, ...]:
        """The W4 layout's words, scales and zeros."""
        w4 = self.w4
        return w4.packed, w4.scales, w4.zeros

    @property
    def repacked(self) -> bool:
        return "packed" in self._parameters

    @property
    def w4(self) -> W4Weight:
        if not self.repacked:
            self.finish_loading()  # a layer filled by hand (tests): repack on first use
        return W4Weight(self.packed, self.w4_scales, self.w4_zeros, self.group_size)

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Replaces the checkpoint-layout parameters by the W4 layout, one slice of output columns at a time."""
        if self.repacked:
            return
        n, k, g = self.out_features, self.in_features, self.group_size
        dev = self.qweight.device
        packed = torch.empty(n, k // 8, dtype=torch.int32, device=dev)
        scales = torch.empty(n, k // g, dtype=self.scales.dtype, device=dev)
        zeros = torch.empty(n, k // g, dtype=torch.uint8, device=dev)
        for c0 in range(0, n, REPACK_COLUMNS):
            c1 = min(n, c0 + REPACK_COLUMNS)
            part = repack_awq(self.qweight[:, c0 // 8:c1 // 8], self.qzeros[:, c0 // 8:c1 // 8],
                              self.scales[:, c0:c1], g)
            packed[c0:c1], scales[c0:c1], zeros[c0:c1] = part.packed, part.scales, part.zeros
        for name in QUANT_PARAMS:
            del self._parameters[name]
        for name, tensor in zip(W4_PARAMS, (packed, scales, zeros)):
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """qweight, qzeros, scales in the AWQ checkpoint layout (rebuilt from W4 once repacked), and bias if any."""
        if self.repacked:
            qweight, qzeros, scales = w4_to_awq(self.w4)
        else:
            qweight, qzeros, scales = self.qweight.data, self.qzeros.data, self.scales.data
        out = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
        if self.bias is not None:
            out["bias"] = self.bias.data
        return out

    @torch.no_grad()
    def pre_dequantize(self, dtype: torch.dtype) -> int:
        """Keeps W [out, in] in `dtype` beside the packed tensors (the seed's V6 pre-dequantisation); returns its
        bytes. The copy is `w4_dequantize` (Triton) on CUDA, `w4_dequantize_ref` elsewhere: the same values either
        way ((q - z) * s is exact in fp32, then rounded once to `dtype`)."""
        if self.w4.packed.is_cuda:
            from orinfer.kernels.w4_mma import w4_dequantize
            self.dense_weight = w4_dequantize(self.w4, dtype)
        else:
            self.dense_weight = w4_dequantize_ref(self.w4, dtype)
        return self.dense_weight.numel() * self.dense_weight.element_size()

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] as a dense matrix (for checks and exports)."""
        return w4_dequantize_ref(self.w4, dtype)

    def weight_bytes(self) -> int:
        """Bytes of the quantized tensors (W4 layout once repacked; bias excluded)."""
        names = W4_PARAMS if self.repacked else QUANT_PARAMS
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)


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

    def shard_view(self, tensor: torch.Tensor, shard: object, kind: str) -> torch.Tensor:
        """The slice of a checkpoint-layout tensor of `kind` (qweight, qzeros, scales or bias) that holds `shard`."""
        offset, cols = self.shard_offsets[shard]
        if kind == "bias":
            return tensor.narrow(0, offset, cols)
        if kind == "scales":
            return tensor.narrow(1, offset, cols)
        return tensor.narrow(1, offset // 8, cols // 8)  # qweight, qzeros: 8 columns per int32

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
        if shard not in self.shard_offsets:
            raise WeightsError(f"{name}: unknown shard {shard!r} of a packed layer")
        if self.repacked:
            raise WeightsError(f"{name}: the layer was already repacked (load every tensor before finish_loading)")
        kind = next(n for n, p in self._parameters.items() if p is param)
        _check(self.shard_view(param.data, shard, kind), loaded, name)


def pre_dequantize_model(model: nn.Module, dtype: torch.dtype) -> int:
    """The seed's V6 mode (`--pre-dequant`): gives every AWQ linear of `model` (packed qkv / gate_up included) a dense
    copy of its weight in `dtype` (the activation dtype) for prefill, trading memory for prefill speed; decode keeps
    the INT4 kernels. Logs and returns the extra bytes. ConfigError when the model has no AWQ linear."""
    layers = [m for m in model.modules() if isinstance(m, AWQLinear)]
    if not layers:
        raise ConfigError("pre_dequant (--pre-dequant) applies to AWQ INT4 models; this model has no AWQ linears")
    extra = sum(layer.pre_dequantize(dtype) for layer in layers)
    packed = sum(layer.weight_bytes() for layer in layers)
    log.info("pre-dequant (seed V6 mode): %d AWQ linears keep a %s copy for prefill: +%.2f GiB (packed INT4: %.2f GiB)",
             len(layers), str(dtype).removeprefix("torch."), extra / 2**30, packed / 2**30)
    return extra
