"""Model and engine configuration.

`ModelConfig` is the engine's view of a Hugging Face `config.json`: only the fields the forward pass needs, under
one set of names for every supported family. `EngineConfig` holds the knobs of the engine itself (batching limits,
KV-cache size, backend). Presets give the real shapes of published checkpoints for synthetic benchmarks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orinfer.errors import ConfigError

# Architectures the registry can build. Kept here (not in models/) so the config can reject a model before any
# weight is touched, with a message that lists what is supported.
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


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
            raise ConfigError(f"{where}: quant_method {method!r} is not supported; orinfer loads AWQ checkpoints "
                              "(quant_method 'awq', bits 4, zero_point true, version 'gemm')")
        bits = raw.get("bits", raw.get("w_bit", 4))
        if isinstance(bits, bool) or not isinstance(bits, int) or bits != 4:
            raise ConfigError(f"{where}: bits={bits!r} is not supported; AWQ in orinfer is 4-bit only")
        group = raw.get("group_size", raw.get("q_group_size", 128))
        if isinstance(group, bool) or not isinstance(group, int) or (group <= 0 and group != -1):
            raise ConfigError(f"{where}: group_size={group!r} must be a positive integer (or -1: one group)")
        zero_point = raw.get("zero_point", True)
        if zero_point is not True:
            raise ConfigError(f"{where}: zero_point={zero_point!r} is not supported; orinfer needs zero_point true "
                              "(asymmetric AWQ)")
        version = raw.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise ConfigError(f"{where}: version {version!r} is not supported; orinfer reads AWQ's 'gemm' packing "
                              "(qweight [in, out/8])")
        skip = raw.get("modules_to_not_convert") or ()
        if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) for m in skip):
            raise ConfigError(f"{where}: modules_to_not_convert must be a list of module names")
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

    def to_hf_dict(self) -> dict[str, Any]:
        """The `quantization_config` entry AutoAWQ writes (and HF transformers / vLLM read)."""
        return {"quant_method": self.method, "bits": self.bits, "group_size": self.group_size,
                "zero_point": self.zero_point, "version": self.version,
                "modules_to_not_convert": list(self.modules_to_not_convert) or None}


@dataclass
class ModelConfig:
    """Shapes and constants of a Qwen2 / Qwen3 decoder. Field names follow HF's config.json where they exist."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # Qwen2: bias on q/k/v projections
    qk_norm: bool = False             # Qwen3: per-head RMSNorm on q and k before RoPE
    torch_dtype: str = "bfloat16"     # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    quantization: QuantConfig | None = None  # AWQ INT4 weights (config.json's quantization_config), else None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count of the decoder (embeddings and lm_head counted once if tied)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embed + h

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "ModelConfig":
        """Builds the config from a parsed config.json; raises ConfigError naming what is wrong."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            named = ", ".join(archs) if archs else f"model_type={raw.get('model_type')!r}"
            raise ConfigError(
                f"{source}: unsupported architecture {named}; orinfer supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        # Qwen3-style checkpoints may nest the text config; Qwen2/3 causal LMs keep it flat.
        text = raw.get("text_config", raw)
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in text]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        _check_rope(text, source)
        if text.get("use_sliding_window") and text.get("sliding_window") and \
                int(text.get("max_window_layers", 0)) < int(text["num_hidden_layers"]):
            raise ConfigError(f"{source}: sliding-window attention is not supported (set use_sliding_window=false)")
        if text.get("use_sliding_window") and "sliding_attention" in (text.get("layer_types") or []):
            raise ConfigError(f"{source}: sliding-window attention layers are not supported")
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        quant_raw = raw.get("quantization_config", text.get("quantization_config"))
        quant = None if quant_raw is None else QuantConfig.from_hf(quant_raw, source)
        cfg = cls(
            architecture=arch,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            rope_theta=float(_rope_theta(text)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            # Qwen2 always has q/k/v bias (its config has no flag); Qwen3 has `attention_bias` (false in practice).
            attention_bias=arch == "Qwen2ForCausalLM" or bool(text.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or "bfloat16"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            quantization=quant,
        )
        if quant is not None:
            quant.check_model(cfg, source)
        return cfg

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> "ModelConfig":
        """Reads `<model_dir>/config.json`."""
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ConfigError(f"model directory not found: {model_dir}")
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(raw, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that HF transformers (and orinfer) read back as this config."""
        model_type = "qwen3" if self.architecture == "Qwen3ForCausalLM" else "qwen2"
        out = {
            "architectures": [self.architecture], "model_type": model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "torch_dtype": self.torch_dtype, "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
        }
        if model_type == "qwen3":
            out["attention_bias"] = self.attention_bias
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_hf_dict()
        return out


def _rope_theta(text: dict[str, Any]) -> float:
    # transformers 5 moved rope_theta into rope_parameters; older configs keep it top level.
    params = text.get("rope_parameters") or {}
    return params.get("rope_theta", text.get("rope_theta", 10000.0))


def _check_rope(text: dict[str, Any], source: str) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        scaling = text.get(key)
        if isinstance(scaling, dict):
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", None):
                raise ConfigError(f"{source}: rope scaling type {kind!r} is not supported yet (only default RoPE)")


# Real shapes of published checkpoints (from their config.json), for synthetic-weight benchmarks.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, eos_token_id=[151645, 151643]),
    "qwen3-0.6b": dict(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, eos_token_id=[151645, 151643]),
    "qwen2.5-7b": dict(architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, eos_token_id=[151645, 151643]),
}


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a published checkpoint's shapes, e.g. `preset("qwen3-8b")`."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    fields = dict(PRESETS[name])
    arch = fields["architecture"]
    fields.setdefault("attention_bias", arch == "Qwen2ForCausalLM")
    fields.setdefault("qk_norm", arch == "Qwen3ForCausalLM")
    return ModelConfig(**fields)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: str = "bfloat16"
                  ) -> tuple[torch.dtype, torch.dtype]:
    """Maps a user dtype to (weight dtype, activation dtype).

    "auto": bf16 on a GPU, fp32 on the CPU (16-bit matmuls on CPUs are slow and imprecise). "mixed" is the seed's
    mode: weights stay in the checkpoint's 16-bit type, activations (and the KV cache) run in fp32.
    """
    if isinstance(dtype, torch.dtype):
        return dtype, dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        chosen = torch.bfloat16 if device.type == "cuda" else torch.float32
        return chosen, chosen
    if name == "mixed":
        weight = _DTYPES.get(checkpoint_dtype, torch.bfloat16)
        if weight == torch.float32:
            weight = torch.bfloat16
        return weight, torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16, float32 or mixed")
    return _DTYPES[name], _DTYPES[name]


@dataclass
class EngineConfig:
    """Knobs of the engine (not of the model)."""

    max_num_seqs: int = 64                 # sequences decoded together at most
    max_num_batched_tokens: int = 8192     # tokens in one prefill step at most
    block_size: int = 16                   # tokens per KV-cache block
    max_model_len: int | None = None       # context length; default: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.90   # share of GPU memory the engine may use (weights + KV cache + work)
    kv_cache_bytes: int | None = None      # explicit KV-cache budget; default: from free memory (GPU) or 1 GiB (CPU)
    num_kv_blocks: int | None = None       # explicit block count (tests use it to force preemption)
    backend: str = "auto"                  # "torch" | "triton" | "auto" (triton on CUDA, torch on CPU)
    cuda_graph: bool = True                # replay decode steps as CUDA graphs (triton backend)
    fused_ffn: bool = True                 # fused gate/up + SwiGLU decode kernel (triton backend)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
