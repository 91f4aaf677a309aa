"""Mixture-of-experts configs: the published MoE releases' config.json (tests/data/real-qwen) parse with their real
shapes and parameter counts; which layers are sparse follows HF's own classes; defaults, aliases and errors; quantized
MoE checkpoints are refused naming the format; the presets write a config.json that HF and orinfer read back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from orinfer.config import ModelConfig, preset
from orinfer.errors import ConfigError
from orinfer.layers.moe import SparseMoE
from orinfer.layers.ops import TORCH_OPS
from orinfer.models.registry import build_model

REAL = Path(__file__).parent / "data" / "real-qwen"


def _raw(name: str) -> dict:
    return json.loads((REAL / name / "config.json").read_text())


@pytest.mark.parametrize("name, arch, experts, top_k, width, shared, layers, billions, active", [
    ("Qwen3-30B-A3B", "Qwen3MoeForCausalLM", 128, 8, 768, 0, 48, 30.5, 3.3),   # the model card: 30.5B, 3.3B active
    ("Qwen3-Coder-480B-A35B-Instruct", "Qwen3MoeForCausalLM", 160, 8, 2560, 0, 62, 480, 35),
    ("Qwen3-VL-30B-A3B-Instruct", "Qwen3VLMoeForConditionalGeneration", 128, 8, 768, 0, 48, 30.5, 3.3),
    # Qwen3.5's decoders (the vision tower adds ~0.4B to the names' totals).
    ("Qwen3.5-35B-A3B", "Qwen3_5MoeForConditionalGeneration", 256, 8, 512, 512, 40, 34.7, 3.4),
    ("Qwen3.6-35B-A3B", "Qwen3_5MoeForConditionalGeneration", 256, 8, 512, 512, 40, 34.7, 3.4),
    ("Qwen3.5-122B-A10B", "Qwen3_5MoeForConditionalGeneration", 256, 8, 1024, 1024, 48, 122, 9.8),
    ("Qwen3.5-397B-A17B", "Qwen3_5MoeForConditionalGeneration", 512, 10, 1024, 1024, 60, 396, 17.3),
])
def test_published_moe_configs_parse(name, arch, experts, top_k, width, shared, layers, billions, active):
    cfg = ModelConfig.from_hf(REAL / name)
    assert cfg.architecture == arch and cfg.is_moe and cfg.quantization is None
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (experts, top_k, width)
    assert cfg.shared_expert_intermediate_size == shared and cfg.norm_topk_prob
    assert cfg.num_hidden_layers == cfg.num_sparse_layers == layers  # every layer sparse in every release
    assert cfg.num_parameters() / 1e9 == pytest.approx(billions, rel=0.01)
    assert cfg.num_parameters(active=True) / 1e9 == pytest.approx(active, rel=0.02)
    assert cfg.is_hybrid == ("Qwen3_5" in arch) and cfg.is_multimodal == ("Conditional" in arch)


def _hf_qwen3_moe_config(**fields):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=16, hidden_size=8, intermediate_size=12, moe_intermediate_size=4,
                          num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                          num_experts_per_tok=2, **fields)


@pytest.mark.parametrize("fields", [
    dict(num_experts=4), dict(num_experts=4, decoder_sparse_step=2), dict(num_experts=4, decoder_sparse_step=3,
                                                                          mlp_only_layers=[2]),
    dict(num_experts=4, mlp_only_layers=[0, 3, 5]), dict(num_experts=4, decoder_sparse_step=4, mlp_only_layers=[1]),
    dict(num_experts=0),
])
def test_sparse_layers_are_hfs(fields):
    """The layers HF's Qwen3MoeForCausalLM builds a sparse block for (from its own config.json, which names the expert
    count num_local_experts) are the layers orinfer routes, and the others are dense MLPs."""
    from transformers import Qwen3MoeForCausalLM

    hf_config = _hf_qwen3_moe_config(**fields)
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(hf_config)
    want = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    raw = json.loads(hf_config.to_json_string()) | {"architectures": ["Qwen3MoeForCausalLM"]}
    assert "num_local_experts" in raw and "num_experts" not in raw
    cfg = ModelConfig.from_dict(raw)
    assert cfg.num_experts == fields["num_experts"]
    assert [cfg.is_sparse_layer(i) for i in range(6)] == want
    model = build_model(cfg, TORCH_OPS, torch.float32, torch.float32, torch.device("meta"))
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.layers] == want
    assert cfg.is_moe == any(want)


def test_defaults_follow_hfs_config_classes():
    """Left out: Qwen3-MoE does not renormalise (norm_topk_prob false) and every layer is sparse; Qwen3.5-MoE needs
    no intermediate_size; Qwen3-VL-MoE always renormalises."""
    raw = _raw("Qwen3-30B-A3B")
    for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        del raw[key]
    cfg = ModelConfig.from_dict(raw)
    assert not cfg.norm_topk_prob and cfg.num_sparse_layers == 48
    raw = _raw("Qwen3.5-35B-A3B")
    assert "intermediate_size" not in raw["text_config"] and ModelConfig.from_dict(raw).intermediate_size == 0
    raw = _raw("Qwen3-VL-30B-A3B-Instruct")
    del raw["text_config"]["norm_topk_prob"]
    assert ModelConfig.from_dict(raw).norm_topk_prob


@pytest.mark.parametrize("name, edit, message", [
    ("Qwen3-30B-A3B", dict(num_experts_per_tok=129), "num_experts_per_tok=129 is more than num_experts=128"),
    ("Qwen3-30B-A3B", dict(decoder_sparse_step=0), "decoder_sparse_step must be an integer >= 1"),
    ("Qwen3-30B-A3B", dict(mlp_only_layers=[3, 48]), r"mlp_only_layers names layer\(s\) \[48\]"),
    ("Qwen3-30B-A3B", dict(moe_intermediate_size=0), "moe_intermediate_size must be an integer >= 1"),
    ("Qwen3-30B-A3B", dict(hidden_act="gelu"), "hidden_act"),
    ("Qwen3-30B-A3B", dict(intermediate_size=None, mlp_only_layers=[0]), "intermediate_size"),
    ("Qwen3-VL-30B-A3B-Instruct", dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    ("Qwen3.5-35B-A3B", dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    ("Qwen3.5-35B-A3B", dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported"),
    ("Qwen3.5-35B-A3B", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("Qwen3.5-35B-A3B", dict(num_experts=0), "num_experts must be an integer >= 1"),
])
def test_unsupported_fields_are_named(name, edit, message):
    raw = _raw(name)
    text = raw.get("text_config", raw)
    for key, value in edit.items():
        if value is None:
            del text[key]
        else:
            text[key] = value
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


AWQ_128 = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ_128 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "Qwen3.5-35B-A3B"])
@pytest.mark.parametrize("quant", [AWQ_128, GPTQ_128], ids=["awq", "gptq4"])
def test_4_bit_experts_of_the_published_shapes_are_read(name, quant):
    """AWQ and 4-bit GPTQ MoE checkpoints load with 4-bit experts (layers/w4_experts.py)."""
    raw = _raw(name)
    raw["quantization_config"] = quant
    cfg = ModelConfig.from_dict(raw)
    assert cfg.is_moe and cfg.quantization.method == quant["quant_method"]


@pytest.mark.parametrize("edit, message", [
    ({**GPTQ_128, "bits": 8}, "GPTQ 8-bit weights are not supported for MoE experts"),
    ({**GPTQ_128, "desc_act": True}, r"act-order \(desc_act true\) is not supported for MoE experts"),
    ({**AWQ_128, "group_size": 96}, r"group_size \(96\) to divide it"),
])
def test_unsupported_4_bit_expert_variants_are_refused_by_name(edit, message):
    raw = _raw("Qwen3-30B-A3B")
    raw["quantization_config"] = edit
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B-FP8", "Qwen3.5-122B-A10B-FP8-probable"])
def test_published_fp8_moe_configs_are_read(name):
    """FP8 experts load (layers/fp8_experts.py); the routers the lists name stay 16-bit in any case."""
    cfg = ModelConfig.from_hf(REAL / name)
    assert cfg.is_moe and cfg.quantization.method == "fp8" and cfg.quantization.block_size == (128, 128)
    assert any(m.endswith("layers.0.mlp.gate") for m in cfg.quantization.modules_to_not_convert)


def test_online_fp8_of_an_moe_model_is_accepted():
    from orinfer.loader import online_quantization

    cfg = online_quantization(ModelConfig.from_hf(REAL / "Qwen3-30B-A3B"), "fp8")
    assert cfg.quantization.online and cfg.is_moe


@pytest.mark.parametrize("name, published, hf_class, differ", [
    ("qwen3-30b-a3b", "Qwen3-30B-A3B", "Qwen3MoeConfig", {"eos_token_id", "bos_token_id"}),
    # The decoder of a vision-language checkpoint, without its MTP head; EOS of generation_config.json.
    ("qwen3.5-35b-a3b", "Qwen3.5-35B-A3B", "Qwen3_5MoeTextConfig",
     {"architecture", "eos_token_id", "mtp_num_hidden_layers", "vision_config", "mrope_section", "image_token_id",
      "video_token_id", "vision_start_token_id", "vision_end_token_id"}),
    ("qwen3.5-122b-a10b", "Qwen3.5-122B-A10B", "Qwen3_5MoeTextConfig",
     {"architecture", "eos_token_id", "mtp_num_hidden_layers", "vision_config", "mrope_section", "image_token_id",
      "video_token_id", "vision_start_token_id", "vision_end_token_id"}),
])
def test_presets_are_the_published_shapes(name, published, hf_class, differ):
    """A preset's config.json: HF builds its config class from it (the bench's HF baseline), orinfer reads back the
    same ModelConfig, and it differs from the published release only in what a text-only preset leaves out."""
    from transformers import AutoConfig

    cfg = preset(name)
    raw = cfg.to_hf_dict()
    assert ModelConfig.from_dict(raw) == cfg
    hf = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    assert type(hf).__name__ == hf_class and hf.num_experts == cfg.num_experts
    real = ModelConfig.from_hf(REAL / published)
    assert {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(real, f.name)} == differ
