"""Quantization settings read from config.json's `quantization_config` (re-exported by orinfer.config): AWQ here,
FP8 block-wise in fp8_config.py, GPTQ in gptq_config.py; `parse_quantization_config` picks by quant_method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orinfer.errors import ConfigError
from orinfer.quant_fields import group_size_field, module_list_field
from orinfer.fp8_config import FP8Config
from orinfer.gptq_config import GPTQConfig

if TYPE_CHECKING:
    from orinfer.config import ModelConfig


@dataclass(frozen=True)
class QuantConfig:
    """Weight quantization from config.json's `quantization_config`. Only AWQ's W4A16 "gemm" layout is supported:
    4-bit weights in groups of `group_size` input channels, a 4-bit zero point and an fp16 scale per group and
    output channel (per linear: qweight [in, out/8] int32, qzeros [in/group, out/8] int32, scales [in/group, out]).
    group_size -1 means one group over all input channels. Embeddings, norms and lm_head stay 16-bit."""

    method: str = "awq"
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: tuple[str, ...] = ()

    def group_for(self, in_features: int) -> int:
        """The group size of a linear with `in_features` inputs (-1: a single group)."""
        return in_features if self.group_size == -1 else self.group_size

    @classmethod
    def from_hf(cls, raw: Any, source: str = "config") -> "QuantConfig":
        """Parses and validates a `quantization_config` dict; raises ConfigError naming the unsupported value."""
        where = f"{source}: quantization_config"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be a JSON object, got {type(raw).__name__}")
        method = raw.get("quant_method")
        if not isinstance(method, str) or method.lower() != "awq":
            raise ConfigError(f"{where}: quant_method {method!r} is not supported; orinfer loads AWQ "
                              "(bits 4, zero_point true, version 'gemm'), GPTQ (symmetric, 4 or 8 bits) and "
                              "block-wise FP8 checkpoints")
        bits = raw.get("bits", raw.get("w_bit", 4))
        if isinstance(bits, bool) or not isinstance(bits, int) or bits != 4:
            raise ConfigError(f"{where}: bits={bits!r} is not supported; AWQ in orinfer is 4-bit only")
        group = group_size_field(raw, where, "group_size", "q_group_size")
        zero_point = raw.get("zero_point", True)
        if zero_point is not True:
            raise ConfigError(f"{where}: zero_point={zero_point!r} is not supported; orinfer needs zero_point true "
                              "(asymmetric AWQ)")
        version = raw.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise ConfigError(f"{where}: version {version!r} is not supported; orinfer reads AWQ's 'gemm' packing "
                              "(qweight [in, out/8])")
        skip = module_list_field(raw, where)
        return cls(method="awq", bits=4, group_size=group, zero_point=True, version="gemm",
                   modules_to_not_convert=tuple(skip))

    def check_model(self, cfg: "ModelConfig", source: str = "config") -> None:
        """Checks that every decoder linear can be packed: in_features divisible by the group size, out_features
        (of every packed shard) a multiple of 8; and that no decoder linear is left unquantized."""
        where = f"{source}: quantization_config"
        linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        for name in self.modules_to_not_convert:
            if name.rsplit(".", 1)[-1] in linears:
                raise ConfigError(f"{where}: modules_to_not_convert lists {name!r}; orinfer needs every decoder "
                                  "linear quantized")
        shapes = {  # name: (in_features, out_features)
            "q_proj": (cfg.hidden_size, cfg.q_size), "k_proj": (cfg.hidden_size, cfg.kv_size),
            "v_proj": (cfg.hidden_size, cfg.kv_size), "o_proj": (cfg.q_size, cfg.hidden_size),
            "gate_proj": (cfg.hidden_size, cfg.intermediate_size), "up_proj": (cfg.hidden_size, cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size),
        }
        for name, (fin, fout) in shapes.items():
            if fin % self.group_for(fin):
                raise ConfigError(f"{where}: group_size={self.group_size} does not divide {name}'s in_features={fin}")
            if fout % 8:
                raise ConfigError(f"{where}: {name}'s out_features={fout} is not a multiple of 8, which AWQ's "
                                  "int32 packing needs")

    def check_loadable(self, cfg: "ModelConfig") -> None:
        """Everything check_model accepts loads."""

    def to_hf_dict(self) -> dict[str, Any]:
        """The `quantization_config` entry AutoAWQ writes (and HF transformers / vLLM read)."""
        return {"quant_method": self.method, "bits": self.bits, "group_size": self.group_size,
                "zero_point": self.zero_point, "version": self.version,
                "modules_to_not_convert": list(self.modules_to_not_convert) or None}


# Any weight format's settings: what ModelConfig.quantization holds.
AnyQuantConfig = QuantConfig | FP8Config | GPTQConfig


def parse_quantization_config(raw: Any, source: str = "config") -> AnyQuantConfig:
    """The settings of config.json's `quantization_config`, by its quant_method; ConfigError for anything orinfer
    does not load, naming the field and value."""
    if isinstance(raw, dict):
        method = raw.get("quant_method")
        if method == "fp8":
            return FP8Config.from_hf(raw, source)
        if method == "gptq":
            return GPTQConfig.from_hf(raw, source)
    return QuantConfig.from_hf(raw, source)  # AWQ, or the error naming quant_method
