"""Tiny random Qwen models built with HF transformers' own classes: the reference for orinfer's correctness tests."""

from __future__ import annotations

import math
from pathlib import Path

import torch

# Odd shapes on purpose: GQA 1:1, 2:1 and 4:1, head_dim != hidden/heads, tied and untied heads.
CONFIGS = {
    "qwen3-gqa4-untied": dict(arch="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=24, intermediate_size=96, num_hidden_layers=3, tie_word_embeddings=False),
    "qwen3-mha-tied": dict(arch="qwen3", hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
                           head_dim=16, intermediate_size=80, num_hidden_layers=2, tie_word_embeddings=True),
    "qwen2-gqa2-untied": dict(arch="qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, intermediate_size=112, num_hidden_layers=2, tie_word_embeddings=False),
    "qwen2-gqa4-tied": dict(arch="qwen2", hidden_size=96, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=20, intermediate_size=64, num_hidden_layers=2, tie_word_embeddings=True),
}


def randomize_parameters(model, seed: int):
    """Every parameter redrawn so no term of the math can be wrong without showing in the outputs: norm scales near
    1, biases small, embedding / position tables unit normal, matrices fan-in scaled (a Conv3d kernel [out, C, T, P,
    P] by its C*T*P*P inputs, fused experts [E, out, in] by `in`). Returns the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            module = name.rsplit(".", 2)[-2]
            if "norm" in module and name.endswith(".weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif param.dim() == 1:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name or "pos_embed" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            elif module == "experts" and param.dim() == 3:  # fused experts [E, out, in]: each expert's fan-in
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param[0].numel()))
    return model


def build_hf_model(kind: str, vocab_size: int = 211, seed: int = 0, **overrides):
    """An HF Qwen2/Qwen3 causal LM with weights large enough that greedy choices are not near-ties; `overrides`
    replace fields of CONFIGS[kind] (e.g. sizes that are multiples of 128 for AWQ's group size)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    spec = dict(CONFIGS[kind]) | overrides
    arch = spec.pop("arch")
    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(vocab_size=vocab_size, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                        bos_token_id=None, eos_token_id=vocab_size - 1, pad_token_id=None, **spec)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize_parameters(model_cls(config).eval(), seed)


def save_hf_model(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def rewrite_checkpoint(path: Path, out: Path, transform) -> Path:
    """A copy of the one-file checkpoint in `path` at `out`, its tensors passed through `transform(dict) -> dict`."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for item in path.iterdir():
        if item.suffix != ".safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    save_file(transform(load_file(str(path / "model.safetensors"))), str(out / "model.safetensors"))
    return out


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by full recomputation (no cache tricks): the plainest possible reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


# --- Qwen3-VL ---------------------------------------------------------------------------------------------------------

# Token ids of the vision markers in the tiny VL models (the top of a 300-token vocabulary).
VL_IDS = dict(image_token_id=290, video_token_id=291, vision_start_token_id=288, vision_end_token_id=289)
# Two shapes: untied head with DeepStack into the first 2 of 3 decoder layers; tied head with DeepStack into every
# layer (so the last feature lands right before the final norm). head_dim 16: 8 rotary frequencies split 3/3/2.
VL_CONFIGS = {
    "vl-untied": dict(text=dict(num_hidden_layers=3, tie=False), deepstack=[0, 1], depth=3),
    "vl-tied-deepstack-all": dict(text=dict(num_hidden_layers=3, tie=True), deepstack=[0, 1, 2], depth=4),
}


def build_hf_vl_model(kind: str = "vl-untied", vocab_size: int = 300, seed: int = 0):
    """An HF Qwen3VLForConditionalGeneration from a tiny random Qwen3VLConfig, every parameter randomized (norm
    weights 1 + 0.2*randn, biases 0.1*randn) so that no error can hide behind identity-initialised layers."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    spec = VL_CONFIGS[kind]
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                num_hidden_layers=spec["text"]["num_hidden_layers"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=spec["depth"], hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=64, deepstack_visual_indexes=spec["deepstack"], patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=spec["text"]["tie"],
                           **VL_IDS)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize_parameters(Qwen3VLForConditionalGeneration(config).eval(), seed)


def hf_vl_logits(model, ids: list[int], pixel_values: torch.Tensor | None = None,
                 grids: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
    """HF's logits [L, V] for a prompt with expanded image placeholders (M-RoPE from HF's own get_rope_index)."""
    inp = torch.tensor([ids])
    kwargs = {}
    if pixel_values is not None:
        kwargs = dict(pixel_values=pixel_values, image_grid_thw=torch.tensor(grids),
                      mm_token_type_ids=(inp == model.config.image_token_id).int())
    with torch.no_grad():
        return model(input_ids=inp, **kwargs).logits[0]


def hf_vl_greedy(model, ids: list[int], steps: int, pixel_values: torch.Tensor | None = None,
                 grids: list[tuple[int, int, int]] | None = None) -> list[int]:
    """Greedy continuation by full recomputation, images included at every step."""
    out = list(ids)
    for _ in range(steps):
        out.append(int(hf_vl_logits(model, out, pixel_values, grids)[-1].argmax()))
    return out[len(ids):]


# --- Qwen3.5 (hybrid Gated DeltaNet + gated attention) ---------------------------------------------------------------

# Layer patterns, key heads fewer than value heads, partial rotary, tied and untied heads. head_dim 16 with a rotary
# factor of 0.25 turns 4 dims (2 frequencies); the M-RoPE split then covers them.
QWEN3_5_CONFIGS = {
    "qwen3.5-interval4-untied": dict(num_hidden_layers=4, full_attention_interval=4, tie_word_embeddings=False,
                                     linear_num_key_heads=2, linear_num_value_heads=4, partial_rotary_factor=0.25),
    "qwen3.5-mixed-tied": dict(layer_types=["full_attention", "linear_attention", "full_attention",
                                            "linear_attention", "linear_attention"],
                               tie_word_embeddings=True, linear_num_key_heads=2, linear_num_value_heads=2,
                               partial_rotary_factor=0.5),
}


def qwen3_5_text_config(kind: str, vocab_size: int = 211, **overrides):
    """The HF text config of QWEN3_5_CONFIGS[kind]; `overrides` replace its fields (e.g. more value heads per key
    head)."""
    from transformers import Qwen3_5TextConfig

    spec = dict(QWEN3_5_CONFIGS[kind]) | overrides
    factor = spec.pop("partial_rotary_factor")
    if "layer_types" not in spec:
        interval = spec.pop("full_attention_interval")
        spec["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                               for i in range(spec["num_hidden_layers"])]
    spec["num_hidden_layers"] = len(spec["layer_types"])
    fields = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4) | spec
    # M-RoPE sections over the rotary frequencies (head_dim 16: [1, 1, 0] at factor 0.25, [2, 1, 1] at 0.5)
    freqs = int(fields["head_dim"] * factor) // 2
    third, rest = divmod(freqs, 3)
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
        eos_token_id=vocab_size - 1, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor,
                         "mrope_section": [third + (rest > 0), third + (rest > 1), third], "mrope_interleaved": True},
        **fields)
    config._attn_implementation = "eager"
    return config


# The tiny Qwen3.5 vision tower (patches of 8 pixels, no DeepStack).
QWEN3_5_TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64)


def build_hf_qwen3_5(kind: str, seed: int = 0, vision: bool = False, **overrides):
    """An HF Qwen3_5ForCausalLM (or, with `vision`, a Qwen3_5ForConditionalGeneration with a tiny vision tower);
    `overrides` replace fields of QWEN3_5_CONFIGS[kind]."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    text = qwen3_5_text_config(kind, vocab_size=300 if vision else 211, **overrides)
    classes = (Qwen3_5Config, Qwen3_5ForConditionalGeneration) if vision else Qwen3_5ForCausalLM
    return _hf_qwen3_5_family(text, seed, classes)


def _hf_qwen3_5_family(text, seed: int, classes):
    """The causal LM `classes` of a Qwen3.5-family text config, or with (config class, model class) the
    ConditionalGeneration model with the tiny vision tower; every parameter randomized."""
    torch.manual_seed(seed)
    if not isinstance(classes, tuple):
        return randomize_parameters(classes(text).eval(), seed)
    config_cls, model_cls = classes
    config = config_cls(text_config=text.to_dict(), vision_config=QWEN3_5_TINY_VISION,
                        tie_word_embeddings=text.tie_word_embeddings, **VL_IDS)
    config._attn_implementation = "eager"
    return randomize_parameters(model_cls(config).eval(), seed)


# --- mixture of experts (Qwen3-MoE, Qwen3.5-MoE, Qwen3-VL-MoE) ------------------------------------------------------

# Experts fewer than a batch's rows (3) and more (16); top-1 and top-4; renormalised or not; dense layers among sparse
# ones by decoder_sparse_step (layers 1 and 3 sparse) and by mlp_only_layers (layer 1 dense); tied and untied heads.
QWEN3_MOE_CONFIGS = {
    "qwen3moe-e3-top1-step2": dict(num_experts=3, num_experts_per_tok=1, norm_topk_prob=False, decoder_sparse_step=2,
                                   num_hidden_layers=4, tie_word_embeddings=False),
    "qwen3moe-e16-top4-dense1": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
                                     num_hidden_layers=3, tie_word_embeddings=True),
}
# Qwen3.5-MoE: every layer sparse with a shared expert; three linear-attention layers then a full one, or a mix. The
# shared expert as wide as the routed experts, as in every published config (orinfer folds it into the experts: one
# more slot), or wider (a separate MLP beside them).
QWEN3_5_MOE_CONFIGS = {
    "qwen3.5moe-e6-top2": dict(base="qwen3.5-interval4-untied", num_experts=6, num_experts_per_tok=2),
    "qwen3.5moe-e12-top3-tied": dict(base="qwen3.5-mixed-tied", num_experts=12, num_experts_per_tok=3,
                                     shared_expert_intermediate_size=40),
}


def build_hf_qwen3_moe(kind: str, vocab_size: int = 211, seed: int = 0, **overrides):
    """An HF Qwen3MoeForCausalLM: experts of width 24 beside dense layers of width 80 (so a mix-up shows);
    `overrides` replace config fields (4-bit tests: experts of width 32, whole groups)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=vocab_size - 1,
                  pad_token_id=None, **QWEN3_MOE_CONFIGS[kind])
    config = Qwen3MoeConfig(**(fields | overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize_parameters(Qwen3MoeForCausalLM(config).eval(), seed)


def build_hf_qwen3_5_moe(kind: str, seed: int = 0, vision: bool = False, **overrides):
    """An HF Qwen3_5MoeForCausalLM (with `vision`, a Qwen3_5MoeForConditionalGeneration): a QWEN3_5_CONFIGS decoder
    whose MLPs are experts of width 24 and a shared expert of width 24 (or the QWEN3_5_MOE_CONFIGS entry's);
    `overrides` replace text config fields."""
    from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                              Qwen3_5MoeTextConfig)

    spec = dict(QWEN3_5_MOE_CONFIGS[kind])
    dense = qwen3_5_text_config(spec.pop("base"), vocab_size=300 if vision else 211).to_dict()
    for key in ("intermediate_size", "model_type", "architectures", "transformers_version"):
        dense.pop(key, None)
    fields = dense | dict(moe_intermediate_size=24, shared_expert_intermediate_size=24) | spec | overrides
    text = Qwen3_5MoeTextConfig(**fields)
    text._attn_implementation = "eager"
    classes = (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if vision else Qwen3_5MoeForCausalLM
    return _hf_qwen3_5_family(text, seed, classes)


def build_hf_vl_moe(seed: int = 0, **text_overrides):
    """An HF Qwen3VLMoeForConditionalGeneration: the "vl-untied" shape (DeepStack into layers 0 and 1 of 3) with 5
    experts, top 2, and layer 0 dense (mlp_only_layers); `text_overrides` replace fields of its text config."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_experts=5,
                num_experts_per_tok=2, mlp_only_layers=[0], num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, num_hidden_layers=3,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2],
                                 "mrope_interleaved": True}) | text_overrides
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=64, deepstack_visual_indexes=[0, 1], patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2)
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **VL_IDS)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize_parameters(Qwen3VLMoeForConditionalGeneration(config).eval(), seed)
