"""The mixture-of-experts fields of a config.json: Qwen3-MoE, the Qwen3.5-family MoE (text and vision-language) and
Qwen3-VL-MoE.

`moe_fields` turns a (text) config into the ModelConfig keyword arguments of the sparse layers, with HF's defaults
and HF's rule for which layers are sparse. The three families read the same field names but honour different ones:

- Qwen3-MoE (`Qwen3MoeForCausalLM`): top-k weights renormalised only with `norm_topk_prob` (default false); layer i
  is sparse when i is not in `mlp_only_layers`, `num_experts` > 0 and (i + 1) % `decoder_sparse_step` == 0, else a
  dense SwiGLU of `intermediate_size`; no shared expert.
- Qwen3-VL-MoE's decoder: Qwen3-MoE's layer rule, but its router always renormalises.
- Qwen3.5-MoE: every layer sparse, always renormalised, plus a shared expert (`shared_expert_intermediate_size`)
  behind a sigmoid gate.
Where HF's class ignores a field that would change the model (norm_topk_prob false, decoder_sparse_step != 1 for
Qwen3.5), the config is refused rather than guessed at: other engines honour some of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orinfer.errors import ConfigError

if TYPE_CHECKING:
    from orinfer.config import ModelConfig

QWEN3_MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
QWEN3_5_MOE_ARCHITECTURE = "Qwen3_5MoeForCausalLM"
QWEN3_5_MOE_VL_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
QWEN3_VL_MOE_ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"

# HF's config classes' defaults, for fields a config leaves out.
_DEFAULTS: dict[str, dict[str, int]] = {
    QWEN3_MOE_ARCHITECTURE: dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    QWEN3_VL_MOE_ARCHITECTURE: dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408),
    QWEN3_5_MOE_ARCHITECTURE: dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                   shared_expert_intermediate_size=512),
}
_DEFAULTS[QWEN3_5_MOE_VL_ARCHITECTURE] = _DEFAULTS[QWEN3_5_MOE_ARCHITECTURE]
MOE_ARCHITECTURES = tuple(_DEFAULTS)
# Qwen3.5's MoE decoders: every layer sparse, with a shared expert.
HYBRID_MOE_ARCHITECTURES = (QWEN3_5_MOE_ARCHITECTURE, QWEN3_5_MOE_VL_ARCHITECTURE)


def moe_fields(text: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """ModelConfig's MoE fields for a checkpoint of `arch` (one of MOE_ARCHITECTURES) from its (text) config."""
    defaults = _DEFAULTS[arch]
    layers = int(text["num_hidden_layers"])
    # transformers 5 writes Qwen3-MoE's and Qwen3-VL-MoE's expert count as num_local_experts (its attribute map).
    key = "num_experts" if "num_experts" in text or "num_local_experts" not in text else "num_local_experts"
    experts = _count(text, key, {key: defaults["num_experts"]}, source,
                     minimum=1 if arch in HYBRID_MOE_ARCHITECTURES else 0)
    top_k = _count(text, "num_experts_per_tok", defaults, source, minimum=1)
    if experts and top_k > experts:
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} is more than num_experts={experts}")
    fields: dict[str, Any] = dict(num_experts=experts, num_experts_per_tok=top_k,
                                  moe_intermediate_size=_count(text, "moe_intermediate_size", defaults, source,
                                                                minimum=1))
    if arch in HYBRID_MOE_ARCHITECTURES:
        # HF's Qwen3.5-MoE decoder layer is always sparse; mlp_only_layers is refused by hybrid_fields.
        if text.get("decoder_sparse_step", 1) != 1:
            raise ConfigError(f"{source}: decoder_sparse_step={text['decoder_sparse_step']!r} is not supported for "
                              f"{arch} (every layer of it is sparse)")
        fields["shared_expert_intermediate_size"] = _count(text, "shared_expert_intermediate_size", defaults, source,
                                                           minimum=0)
    else:
        # No shared expert in these families (Qwen3-Coder's config writes shared_expert_intermediate_size 0; HF
        # ignores the field).
        step = _count(text, "decoder_sparse_step", {"decoder_sparse_step": 1}, source, minimum=1)
        only = text.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}")
        outside = [i for i in only if not 0 <= i < layers]
        if outside:
            raise ConfigError(f"{source}: mlp_only_layers names layer(s) {outside} of a {layers}-layer model")
        fields.update(decoder_sparse_step=step, mlp_only_layers=tuple(sorted(set(only))))
    if arch == QWEN3_MOE_ARCHITECTURE:
        fields["norm_topk_prob"] = bool(text.get("norm_topk_prob", False))
    else:
        if text.get("norm_topk_prob", True) is not True:
            raise ConfigError(f"{source}: norm_topk_prob={text['norm_topk_prob']!r} is not supported for {arch} "
                              "(its router renormalises the top-k weights)")
        fields["norm_topk_prob"] = True
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {text.get('hidden_act')!r} is not supported (silu only)")
    return fields


def needs_dense_mlp(fields: dict[str, Any], layers: int) -> bool:
    """Whether some layer of a model with these MoE fields is a dense MLP (so intermediate_size is needed)."""
    return any(not sparse_layer(fields.get("num_experts", 0), fields.get("decoder_sparse_step", 1),
                                fields.get("mlp_only_layers", ()), i) for i in range(layers))


def sparse_layer(num_experts: int, decoder_sparse_step: int, mlp_only_layers: tuple[int, ...], index: int) -> bool:
    """HF's rule (Qwen3MoeDecoderLayer): layer `index` (0-based) has routed experts when it is not listed in
    mlp_only_layers, the model has experts, and (index + 1) is a multiple of decoder_sparse_step."""
    return index not in mlp_only_layers and num_experts > 0 and (index + 1) % decoder_sparse_step == 0


def check_moe_weights(cfg: "ModelConfig", source: str) -> None:
    """ConfigError for an MoE model in a weight format its experts do not run. They run 16/32-bit, FP8 block-wise
    (checkpoints and online FP8; layers/fp8_experts.py) and 4-bit AWQ / GPTQ (layers/w4_experts.py: GPTQ without
    act-order; each expert matrix's in_features in whole groups the W4 layout holds, out_features in whole words)."""
    quant = cfg.quantization
    if quant is None or not cfg.is_moe or quant.method == "fp8":
        return
    where = f"{source}: quantization_config"
    if quant.method == "gptq" and quant.bits != 4:
        raise ConfigError(f"{where}: GPTQ {quant.bits}-bit weights are not supported for MoE experts "
                          f"({cfg.architecture}); orinfer runs 4-bit GPTQ experts")
    if quant.method == "gptq" and quant.desc_act:
        raise ConfigError(f"{where}: GPTQ act-order (desc_act true) is not supported for MoE experts "
                          f"({cfg.architecture}): every expert would need its own input permutation")
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    for name, fin, fout in (("gate_proj / up_proj", hidden, inter), ("down_proj", inter, hidden)):
        group = quant.group_for(fin)
        if fin % group or not (group % 128 == 0 or group in (16, 32, 64)):
            raise ConfigError(f"{where}: the experts' {name} has in_features {fin}; {quant.method.upper()} MoE "
                              f"experts need group_size ({quant.group_size}) to divide it and be a multiple of 128 "
                              "or 16, 32, 64")
        if fout % 8:
            raise ConfigError(f"{where}: the experts' {name} has out_features {fout}, not a multiple of 8 (4-bit "
                              "packing)")


def moe_hf_dict(cfg: "ModelConfig", out: dict[str, Any]) -> dict[str, Any]:
    """`out`, the config.json of `cfg`'s dense sibling (Qwen3, Qwen3.5 text, Qwen3-VL), with the MoE fields and
    model types that HF's config classes of `cfg.architecture` read."""
    moe: dict[str, Any] = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                               moe_intermediate_size=cfg.moe_intermediate_size)
    if cfg.architecture in HYBRID_MOE_ARCHITECTURES:  # written as the text decoder, as for the dense family
        dense_only = ("intermediate_size",)
        return {**{k: v for k, v in out.items() if k not in dense_only}, **moe, "model_type": "qwen3_5_moe_text",
                "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
                "architectures": [QWEN3_5_MOE_ARCHITECTURE]}
    moe.update(norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
               mlp_only_layers=list(cfg.mlp_only_layers))
    if cfg.architecture == QWEN3_VL_MOE_ARCHITECTURE:
        return {**out, "model_type": "qwen3_vl_moe",
                "text_config": {**out["text_config"], **moe, "model_type": "qwen3_vl_moe_text"}}
    return {**out, **moe, "model_type": "qwen3_moe"}


def _count(text: dict[str, Any], key: str, defaults: dict[str, int], source: str, minimum: int) -> int:
    value = text.get(key, defaults.get(key))
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{source}: {key} must be an integer >= {minimum}, got {value!r}")
    return value
