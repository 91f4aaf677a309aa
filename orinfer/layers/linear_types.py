"""Weight formats as linear-layer types: the one place that maps a model's quantization config to the class of its
linears, so that model files build `make_linear(...)` and never name a format.

Today: dense 16/32-bit (`Linear`, `PackedLinear`), AWQ INT4 (`AWQLinear`, `AWQPackedLinear`), FP8 block-wise
(`FP8Linear`) and GPTQ 4/8-bit (`GPTQLinear`); each format's class lives in its own layer module. The routed experts
of an MoE layer likewise (`make_experts`): 16/32-bit `ExpertWeights`, FP8 `FP8ExpertWeights`, AWQ and GPTQ-Int4
`W4ExpertWeights`.
"""

from __future__ import annotations

import torch
from torch import nn

from orinfer.errors import ConfigError
from orinfer.fp8_config import FP8Config
from orinfer.gptq_config import GPTQConfig
from orinfer.layers.awq_linear import QUANT_PARAMS, AWQLinear, AWQPackedLinear
from orinfer.layers.fp8_experts import FP8ExpertWeights
from orinfer.layers.fp8_linear import FP8Linear
from orinfer.layers.gptq_linear import GPTQLinear
from orinfer.layers.linear import LinearBase, Linear, PackedLinear
from orinfer.layers.moe import ExpertWeights
from orinfer.layers.w4_experts import W4ExpertWeights
from orinfer.layers.ops import Ops
from orinfer.quant_config import AnyQuantConfig

# Suffixes of tensors that only quantized checkpoints hold.
_QUANTIZED_SUFFIXES = tuple(f".{name}" for name in (*QUANT_PARAMS, "g_idx", "weight_scale_inv"))


def make_linear(quant: AnyQuantConfig | None, in_features: int, out: int | dict[object, int], bias: bool, ops: Ops,
                dtype: torch.dtype, checkpoint_names: dict[object, str] | None = None) -> LinearBase:
    """A linear of the checkpoint's weight format. `out`: output features, or shard id -> output features for a
    layer that packs several checkpoint matrices (q|k|v, gate|up) along its output. `checkpoint_names` (shard id ->
    the checkpoint's module sub-name) lets a format keep some shards unquantized (FP8's modules_to_not_convert)."""
    if quant is None:
        if isinstance(out, dict):
            return PackedLinear(in_features, out, bias, ops, dtype)
        return Linear(in_features, out, bias, ops, dtype)
    shards = out if isinstance(out, dict) else {None: out}
    if isinstance(quant, FP8Config):
        dense = quant.dense_shards(checkpoint_names) if checkpoint_names else ()
        return FP8Linear(in_features, shards, bias, ops, dtype, quant.block_size, online=quant.online,
                         dense_shards=dense)
    if isinstance(quant, GPTQConfig):
        return GPTQLinear(in_features, shards, bias, ops, dtype, quant.bits, quant.group_size)
    group = quant.group_for(in_features)
    if isinstance(out, dict):
        return AWQPackedLinear(in_features, out, bias, ops, dtype, group)
    return AWQLinear(in_features, out, bias, ops, dtype, group)


def make_experts(quant: AnyQuantConfig | None, num_experts: int, hidden: int, intermediate: int, ops: Ops,
                 dtype: torch.dtype) -> ExpertWeights:
    """The routed experts of one MoE layer in the checkpoint's weight format: 16/32-bit, FP8, or 4-bit AWQ / GPTQ
    (config parsing refuses the variants experts do not run: moe_config.check_moe_weights)."""
    if quant is None:
        return ExpertWeights(num_experts, hidden, intermediate, ops, dtype)
    if isinstance(quant, FP8Config):
        return FP8ExpertWeights(num_experts, hidden, intermediate, ops, quant.block_size, online=quant.online)
    if isinstance(quant, GPTQConfig) and (quant.bits != 4 or quant.desc_act):
        raise ConfigError(f"GPTQ {quant.bits}-bit{' act-order' if quant.desc_act else ''} weights are not supported "
                          "for MoE experts (4-bit with desc_act false)")
    fmt = "gptq" if isinstance(quant, GPTQConfig) else "awq"
    return W4ExpertWeights(num_experts, hidden, intermediate, ops, fmt, quant.group_for(hidden),
                           quant.group_for(intermediate))


def misplaced_tensor(hf_name: str, our_name: str, params: dict[str, nn.Parameter],
                     quant: AnyQuantConfig | None) -> str | None:
    """Why a checkpoint tensor that fills no parameter is an error, or None when it is merely extra (HF ignores extra
    tensors too): a quantized tensor in a model whose config.json says unquantized, or a dense weight where every
    decoder linear should be quantized."""
    if quant is None and hf_name.endswith(_QUANTIZED_SUFFIXES):
        return f"checkpoint holds quantized tensor {hf_name} but config.json has no quantization_config"
    if quant is not None and hf_name.endswith(".weight") and our_name.replace(".weight", ".qweight") in params:
        return (f"checkpoint holds a dense {hf_name} where quantization_config says {quant.method.upper()} (every "
                "decoder linear must have qweight/qzeros/scales)")
    return None
