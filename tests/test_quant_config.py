"""quantization_config parsing for FP8 block-wise and GPTQ checkpoints: the published configs, and a clear
ConfigError naming the field for every variant orinfer does not load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orinfer.config import ModelConfig
from orinfer.errors import ConfigError
from orinfer.fp8_config import FP8Config
from orinfer.gptq_config import GPTQConfig
from orinfer.quant_config import parse_quantization_config

REAL = Path(__file__).parent / "data" / "real-qwen"
BASE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 211, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 24}
GOOD_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
GOOD_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}


def _cfg(quant: dict) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, "quantization_config": quant}, source="config.json")


def test_published_fp8_configs_parse():
    dense = ModelConfig.from_hf(REAL / "Qwen3-32B-FP8")
    assert dense.quantization == FP8Config(block_size=(128, 128))
    hybrid = ModelConfig.from_hf(REAL / "Qwen3.6-27B-FP8")  # Qwen3_5ForConditionalGeneration
    assert hybrid.quantization.block_size == (128, 128) and len(hybrid.quantization.modules_to_not_convert) == 882
    for moe in ("Qwen3-30B-A3B-FP8", "Qwen3.5-122B-A10B-FP8-probable"):  # MoE (tests/test_moe_config.py too)
        raw = json.loads((REAL / moe / "config.json").read_text())
        quant = parse_quantization_config(raw["quantization_config"], moe)
        assert isinstance(quant, FP8Config) and quant.block_size == (128, 128)
        assert "lm_head" in quant.modules_to_not_convert


def test_published_gptq_config_parses():
    cfg = ModelConfig.from_hf(REAL / "Qwen2.5-7B-Instruct-GPTQ-Int4")
    assert cfg.quantization == GPTQConfig(bits=4, group_size=128, desc_act=False)
    assert cfg.quantization.pack_factor == 8 and cfg.quantization.num_groups(18944) == 148


def test_qwen3_6_fp8_keeps_in_proj_a_and_b_16_bit():
    """Qwen3.6-27B-FP8 lists every layer's in_proj_a / in_proj_b (and an in_proj_ba orinfer has no matrix for) as
    not converted: the packed in_proj keeps those two shards 16-bit."""
    cfg = ModelConfig.from_hf(REAL / "Qwen3.6-27B-FP8")
    cfg.quantization.check_loadable(cfg)
    names = {"qkv": "in_proj_qkv", "z": "in_proj_z", "b": "in_proj_b", "a": "in_proj_a"}
    assert cfg.quantization.dense_shards(names) == ("b", "a")
    assert cfg.quantization.dense_shards({"q": "q_proj", "k": "k_proj", "v": "v_proj"}) == ()


@pytest.mark.parametrize("quant", [GOOD_FP8, {**GOOD_FP8, "weight_block_size": [16, 32]},
                                   GOOD_GPTQ, {**GOOD_GPTQ, "bits": 8, "group_size": -1, "desc_act": True}])
def test_good_configs_round_trip(quant):
    cfg = _cfg(quant)
    assert ModelConfig.from_dict(cfg.to_hf_dict()).quantization == cfg.quantization


@pytest.mark.parametrize("quant,message", [
    ({**GOOD_FP8, "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({**GOOD_FP8, "activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ({k: v for k, v in GOOD_FP8.items() if k != "weight_block_size"}, "weight_block_size is missing"),
    ({**GOOD_FP8, "weight_block_size": [128]}, r"weight_block_size=\[128\] must be two positive integers"),
    ({**GOOD_FP8, "weight_block_size": [0, 128]}, "must be two positive integers"),
    ({**GOOD_FP8, "weight_per_tensor": True}, "weight_per_tensor=True is not supported"),
    ({**GOOD_FP8, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}, "modules_to_not_convert lists"),
    ({**GOOD_FP8, "modules_to_not_convert": ["model.layers.0.linear_attn.in_proj_z"]}, "modules_to_not_convert lists"),
    ({**GOOD_FP8, "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
    ({**GOOD_GPTQ, "bits": 3}, "bits=3 is not supported"),
    ({**GOOD_GPTQ, "bits": 2}, "bits=2 is not supported"),
    ({**GOOD_GPTQ, "sym": False}, "sym=False is not supported"),
    ({**GOOD_GPTQ, "checkpoint_format": "gptq_v2"}, "checkpoint_format 'gptq_v2' is not supported"),
    ({**GOOD_GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({**GOOD_GPTQ, "group_size": 0}, "group_size=0 must be a positive integer"),
    ({**GOOD_GPTQ, "desc_act": "yes"}, "desc_act='yes' must be true or false"),
    ({**GOOD_GPTQ, "lm_head": True}, "lm_head=true is not supported"),
    ({**GOOD_GPTQ, "dynamic": {"-:.*down_proj": {}}}, "dynamic"),
    ({**GOOD_GPTQ, "modules_to_not_convert": ["model.layers.1.self_attn.o_proj"]}, "modules_to_not_convert lists"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
])
def test_bad_configs_are_clear_errors(quant, message):
    with pytest.raises(ConfigError, match=message) as err:
        _cfg(quant)
    assert "config.json: quantization_config" in str(err.value)


def test_gptq_packing_needs_features_divisible_by_values_per_word():
    with pytest.raises(ConfigError, match="k_proj's out_features=20 is not a multiple of 8"):
        ModelConfig.from_dict({**BASE, "head_dim": 20, "quantization_config": GOOD_GPTQ})
    # 8-bit packs 4 per word: 20 fits
    assert ModelConfig.from_dict({**BASE, "head_dim": 20, "quantization_config": {**GOOD_GPTQ, "bits": 8}})
