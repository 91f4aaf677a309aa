"""Weight formats as linear-layer types: the one place that maps a model's quantization config to the class of its
linears, so that model files build `make_linear(...)` and never name a format.

Today: dense 16/32-bit (`Linear`, `PackedLinear`), AWQ INT4 (`AWQLinear`, `AWQPackedLinear`), FP8 block-wise
(`FP8Linear`) and GPTQ 4/8-bit (`GPTQLinear`); each format's class lives in its own layer module. The routed experts
of an MoE layer likewise (`make_experts`): 16/32-bit `ExpertWeights`, FP8 `FP8ExpertWeights`, AWQ and GPTQ-Int4
`W4ExpertWeights`; and the whole MoE block (`make_sparse_moe`), whose shared expert is folded into the experts when
the format gives it their type (layers/moe.py). A quantized copy of an LM head (`quantized_head`) is a `LinearHead`
over such a linear.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from orinfer.errors import ConfigError
from orinfer.fp8_config import FP8Config
from orinfer.gptq_config import GPTQConfig
from orinfer.layers.awq_linear import QUANT_PARAMS, AWQLinear, AWQPackedLinear
from orinfer.layers.embedding import LinearHead, LMHead
from orinfer.layers.fp8_experts import FP8ExpertWeights
from orinfer.layers.fp8_linear import FP8Linear
from orinfer.layers.gptq_linear import GPTQLinear
from orinfer.layers.linear import LinearBase, Linear, PackedLinear
from orinfer.layers.moe import ExpertWeights, SparseMoE
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


def quantized_head(quant: AnyQuantConfig, head: LMHead) -> LinearHead:
    """A copy of `head` (its rows of the vocabulary) whose logits come from a linear in `quant`, a format that
    quantizes 16/32-bit weights while loading (online FP8, `--quantization fp8`'s), filled now from the head's weight
    as a checkpoint's tensor would be; `head` itself, tied to the embedding or not, is left as it is."""
    if not getattr(quant, "online", False):
        raise ConfigError(f"a quantized copy of the LM head needs a format that quantizes while loading, not "
                          f"{quant.method}")
    weight = head.weight
    with torch.device(weight.device):
        linear = make_linear(quant, weight.shape[1], weight.shape[0], False, head.ops, weight.dtype)
    linear.weight.weight_loader(linear.weight, weight.detach(), None, "lm_head.weight")
    return LinearHead(linear, head.rows, head.vocab_size)


def make_experts(quant: AnyQuantConfig | None, num_experts: int, hidden: int, intermediate: int, ops: Ops,
                 dtype: torch.dtype, shared_slot: bool = False) -> ExpertWeights:
    """The routed experts of one MoE layer in the checkpoint's weight format: 16/32-bit, FP8, or 4-bit AWQ / GPTQ
    (config parsing refuses the variants experts do not run: moe_config.check_moe_weights); `shared_slot`: one more
    slot for a folded shared expert."""
    if quant is None:
        return ExpertWeights(num_experts, hidden, intermediate, ops, dtype, shared_slot)
    if isinstance(quant, FP8Config):
        return FP8ExpertWeights(num_experts, hidden, intermediate, ops, quant.block_size, online=quant.online,
                                shared_slot=shared_slot)
    if isinstance(quant, GPTQConfig) and (quant.bits != 4 or quant.desc_act):
        raise ConfigError(f"GPTQ {quant.bits}-bit{' act-order' if quant.desc_act else ''} weights are not supported "
                          "for MoE experts (4-bit with desc_act false)")
    fmt = "gptq" if isinstance(quant, GPTQConfig) else "awq"
    return W4ExpertWeights(num_experts, hidden, intermediate, ops, fmt, quant.group_for(hidden),
                           quant.group_for(intermediate), shared_slot)


def shared_expert_format(quant: AnyQuantConfig | None) -> AnyQuantConfig | None:
    """The weight format of an MoE layer's shared expert: the model's, or 16-bit when modules_to_not_convert lists
    `shared_expert` (any layer's: the lists name every layer's module, read as FP8Config.dense_shards reads them).
    Qwen's FP8 releases list only the router and the shared expert's gate (`mlp.gate`, `mlp.shared_expert_gate`)."""
    listed = {name.rsplit(".", 1)[-1] for name in getattr(quant, "modules_to_not_convert", ())}
    return None if "shared_expert" in listed else quant


def make_sparse_moe(quant: AnyQuantConfig | None, hidden: int, num_experts: int, top_k: int, renormalize: bool,
                    intermediate: int, ops: Ops, dtype: torch.dtype, shared_intermediate: int = 0,
                    make_shared: Callable[[AnyQuantConfig | None], nn.Module] | None = None) -> SparseMoE:
    """An MoE block: `num_experts` routed experts of width `intermediate` in `quant`'s format, top_k a token, and a
    shared expert of width `shared_intermediate` (0: none). The shared expert is folded into the experts as one more
    slot when it has their width and `shared_expert_format` gives it their format (every published Qwen3.5/3.6 MoE
    checkpoint): its matrices then load into that slot, and the decode step runs it inside the expert kernels.
    Otherwise `make_shared(format)` builds it as a module of its own (the model's MLP at shared_intermediate)."""
    if shared_intermediate and make_shared is None:
        raise ValueError("a shared expert needs make_shared to build it when it cannot be folded")
    shared_format = shared_expert_format(quant)
    fold = 0 < shared_intermediate == intermediate and shared_format is quant
    experts = make_experts(quant, num_experts, hidden, intermediate, ops, dtype, shared_slot=fold)
    shared = make_shared(shared_format) if shared_intermediate and not fold else None
    return SparseMoE(hidden, top_k, renormalize, ops, dtype, experts, shared)


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
