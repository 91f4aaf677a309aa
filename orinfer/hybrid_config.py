"""The Qwen3.5 family's extra config.json fields (Qwen3.5 / 3.6 / 3.8 dense: hybrid Gated DeltaNet + gated attention).

`hybrid_fields` turns a `text_config` into the ModelConfig keyword arguments that only these models have, checking
what orinfer cannot run yet with errors that name the field.
"""

from __future__ import annotations

from typing import Any

from orinfer.errors import ConfigError

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
# The gated RMSNorm after the delta rule gates with silu; Qwen3.8's config names it "swish".
_SILU_GATES = (None, "silu", "swish")


def hybrid_fields(text: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelConfig fields of a qwen3_5_text config: layer pattern, linear-attention shapes, partial rotary, output
    gate, MTP depth."""
    layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        if interval < 1:
            raise ConfigError(f"{source}: full_attention_interval must be >= 1, got {interval}")
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise ConfigError(f"{source}: layer_types must list one kind per layer ({layers}), got {types!r}")
    unknown = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise ConfigError(f"{source}: layer kind(s) {', '.join(map(str, unknown))} not supported; layer_types may hold "
                          f"{FULL_ATTENTION!r} and {LINEAR_ATTENTION!r}")
    if text.get("mlp_only_layers"):
        raise ConfigError(f"{source}: mlp_only_layers is not supported")
    gate = text.get("output_gate_type")
    if gate not in _SILU_GATES:
        raise ConfigError(f"{source}: output_gate_type {gate!r} is not supported (silu / swish only)")
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {text.get('hidden_act')!r} is not supported (silu only)")
    rope = text.get("rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ConfigError(f"{source}: partial_rotary_factor {factor} gives {rotary_dim} rotary dims of {head_dim}")
    fields = dict(
        layer_types=tuple(types),
        linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        partial_rotary_factor=factor,
        attn_output_gate=bool(text.get("attn_output_gate", True)),
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
    )
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        raise ConfigError(f"{source}: linear_num_value_heads={fields['linear_num_value_heads']} is not a multiple of "
                          f"linear_num_key_heads={fields['linear_num_key_heads']}")
    if fields["linear_conv_kernel_dim"] < 2:
        raise ConfigError(f"{source}: linear_conv_kernel_dim must be >= 2, got {fields['linear_conv_kernel_dim']}")
    if text.get("mtp_use_dedicated_embeddings"):
        raise ConfigError(f"{source}: MTP heads with dedicated embeddings are not supported")
    return fields


def hybrid_hf_dict(cfg: "ModelConfig", flat: dict[str, Any]) -> dict[str, Any]:  # noqa: F821 (no import cycle)
    """The qwen3_5_text config.json of a hybrid ModelConfig (HF's Qwen3_5ForCausalLM reads it): `flat`, the fields
    every Qwen config shares, plus the layer pattern, linear-attention shapes and rope parameters."""
    out = {k: v for k, v in flat.items() if k not in ("rope_theta", "use_sliding_window")}
    out.update(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", layer_types=list(cfg.layer_types),
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, attn_output_gate=cfg.attn_output_gate,
        attention_bias=cfg.attention_bias, mtp_num_hidden_layers=cfg.mtp_num_hidden_layers,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor,
                         "mrope_section": list(cfg.mrope_section or (11, 11, 10)), "mrope_interleaved": True})
    return out
