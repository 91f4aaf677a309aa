"""Model and engine configuration.

`ModelConfig` is the engine's view of a Hugging Face `config.json`: only the fields the forward pass needs, under
one set of names for every supported family (the engine's own settings are `orinfer.args.EngineArgs`). Presets give
the real shapes of published checkpoints for synthetic benchmarks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orinfer.errors import ConfigError
from orinfer.hybrid_config import hybrid_fields, hybrid_hf_dict
from orinfer.moe_config import (HYBRID_MOE_ARCHITECTURES, MOE_ARCHITECTURES, QWEN3_5_MOE_ARCHITECTURE,
                                QWEN3_MOE_ARCHITECTURE, QWEN3_VL_MOE_ARCHITECTURE, check_moe_weights, moe_fields,
                                moe_hf_dict, needs_dense_mlp, sparse_layer)
from orinfer.quant_config import AnyQuantConfig, QuantConfig, parse_quantization_config
from orinfer.vl_config import QWEN3_5_VL_ARCHITECTURE, VL_ARCHITECTURE, VL_ARCHITECTURES, vl_fields

__all__ = ["SUPPORTED_ARCHITECTURES", "VL_ARCHITECTURE", "VL_ARCHITECTURES", "HYBRID_ARCHITECTURES",
           "MOE_ARCHITECTURES", "QWEN3_VL_MOE_ARCHITECTURE", "QuantConfig", "ModelConfig", "PRESETS", "preset",
           "resolve_dtype"]

# Architectures the registry can build. Kept here (not in models/) so the config can reject a model before any
# weight is touched, with a message that lists what is supported.
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", VL_ARCHITECTURE, "Qwen3_5ForCausalLM",
                           QWEN3_5_VL_ARCHITECTURE, *MOE_ARCHITECTURES)
# Qwen3.5 / 3.6 / 3.8 dense and MoE (hybrid Gated DeltaNet + gated attention). A ConditionalGeneration checkpoint
# also has a vision tower (VL_ARCHITECTURES: vision-language models, vl_config.py).
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", QWEN3_5_VL_ARCHITECTURE, *HYBRID_MOE_ARCHITECTURES)
# Per-head RMSNorm of q and k (every family but Qwen2).
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", VL_ARCHITECTURE, *HYBRID_ARCHITECTURES, QWEN3_MOE_ARCHITECTURE,
                          QWEN3_VL_MOE_ARCHITECTURE)

_DEFAULT_ROPE_THETA = {VL_ARCHITECTURE: 500_000.0, QWEN3_VL_MOE_ARCHITECTURE: 500_000.0,
                       **dict.fromkeys(HYBRID_ARCHITECTURES, 10_000_000.0)}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


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
    quantization: AnyQuantConfig | None = None  # AWQ, GPTQ or FP8 weights (config.json's quantization_config)
    # Vision-language models only (Qwen3-VL, Qwen3.5 ConditionalGeneration): the raw vision_config dict (the vision
    # tower parses it), the placeholder token ids, and the M-RoPE split of the rotary frequencies (rotary_dim / 2 of
    # them) over the (t, h, w) axes. None for text-only models.
    vision_config: dict[str, Any] | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    mrope_section: tuple[int, int, int] | None = None
    # Qwen3.5 family only (hybrid_config.py): each layer's kind, "full_attention" or "linear_attention" (None: every
    # layer is full attention), the Gated DeltaNet shapes, the share of each head that RoPE turns, the sigmoid
    # output gate of full attention, and the depth of the MTP head (loaded, not run).
    layer_types: tuple[str, ...] | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    mtp_num_hidden_layers: int = 0
    # The MTP head's weight format when it is not the model's, set by the engine's loaders (never read from or
    # written to config.json): the FP8 drafter (speculative_config quantization "fp8", spec_decode/drafter.py) builds
    # every linear of the head in online FP8. None: the head's layers follow `quantization`, its fc stays 16-bit.
    mtp_quantization: AnyQuantConfig | None = None
    # Mixture-of-experts models only (moe_config.py): routed experts of width moe_intermediate_size, top
    # num_experts_per_tok of them per token (weights renormalised over those when norm_topk_prob), a shared expert
    # behind a sigmoid gate (width 0: none), and which layers are sparse (`is_sparse_layer`); the others are dense
    # SwiGLU MLPs of intermediate_size. num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        """Whether some layers route tokens to experts."""
        return self.num_sparse_layers > 0

    def is_sparse_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has routed experts (HF's rule: moe_config.sparse_layer)."""
        return sparse_layer(self.num_experts, self.decoder_sparse_step, self.mlp_only_layers, index)

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.is_sparse_layer(i) for i in range(self.num_hidden_layers))

    @property
    def expert_parameters(self) -> int:
        """Parameters of one routed expert (gate, up and down: 3 H I)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (Gated DeltaNet): sequences then carry per-layer state."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache (full attention)."""
        if self.layer_types is None:
            return self.num_hidden_layers
        return sum(kind == "full_attention" for kind in self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise conv: q, k and v of the linear-attention layers."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def state_bytes_per_sequence(self, conv_elem: int) -> int:
        """Bytes of one sequence's linear-attention state over all layers: conv state (`conv_elem` bytes each) and
        the fp32 delta-rule state."""
        layers = self.num_hidden_layers - self.num_kv_layers
        conv = self.linear_conv_dim * (self.linear_conv_kernel_dim - 1) * conv_elem
        recurrent = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        return layers * (conv + recurrent)

    @property
    def is_multimodal(self) -> bool:
        """True for vision-language checkpoints (a vision tower in front of the decoder)."""
        return self.vision_config is not None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def mlp_parameters(self, index: int, active: bool = False) -> int:
        """Parameters of layer `index`'s feed-forward: a dense SwiGLU, or the router, the routed experts (only the
        num_experts_per_tok a token uses when `active`) and the gated shared expert."""
        h = self.hidden_size
        if not self.is_sparse_layer(index):
            return 3 * h * self.intermediate_size
        routed = self.num_experts_per_tok if active else self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return self.num_experts * h + routed * self.expert_parameters + shared

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count of the decoder (embeddings and lm_head counted once if tied); `active`: with only the
        routed experts one token uses (an MoE model's "A3B")."""
        h, layers = self.hidden_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.attn_output_gate:
            attn += h * self.q_size
        mlp_norms = sum(self.mlp_parameters(index, active) for index in range(layers)) + 2 * h * layers
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        kv_layers = self.num_kv_layers
        linear = 0
        if kv_layers < layers:
            nv = self.linear_num_value_heads
            linear = (h * (self.linear_conv_dim + self.linear_value_dim + 2 * nv) + self.linear_value_dim * h
                      + self.linear_conv_dim * self.linear_conv_kernel_dim + 2 * nv + self.linear_value_head_dim)
        return kv_layers * attn + (layers - kv_layers) * linear + mlp_norms + embed + h

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "ModelConfig":
        """Builds the config from a parsed config.json; raises ConfigError naming what is wrong."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            named = ", ".join(archs) if archs else f"model_type={raw.get('model_type')!r}"
            if any("Moe" in a for a in archs):
                raise ConfigError(f"{source}: {named} is a mixture-of-experts model, not supported yet; orinfer "
                                  f"supports {', '.join(SUPPORTED_ARCHITECTURES)}")
            raise ConfigError(
                f"{source}: unsupported architecture {named}; orinfer supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        # Qwen3-VL nests the decoder's fields in text_config; Qwen2/3 causal LMs keep them flat.
        text = raw.get("text_config", raw)
        if arch in VL_ARCHITECTURES and not isinstance(raw.get("text_config"), dict):
            raise ConfigError(f"{source}: {arch} needs a 'text_config' object")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: text_config must be a JSON object")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        moe = moe_fields(text, arch, source) if arch in MOE_ARCHITECTURES and "num_hidden_layers" in text else {}
        if moe and not needs_dense_mlp(moe, int(text["num_hidden_layers"])):
            required = tuple(k for k in required if k != "intermediate_size")  # no dense MLP (Qwen3.5-MoE's config)
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
        quant = None if quant_raw is None else parse_quantization_config(quant_raw, source)
        hybrid = hybrid_fields(text, source) if arch in HYBRID_ARCHITECTURES else {}
        rotary_dim = int(head_dim * hybrid.get("partial_rotary_factor", 1.0))
        cfg = cls(
            architecture=arch,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text.get("intermediate_size", 0)),
            num_hidden_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            rope_theta=float(_rope_theta(text, _DEFAULT_ROPE_THETA.get(arch, 10_000.0))),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            # Qwen2 always has q/k/v bias (its config has no flag); Qwen3 has `attention_bias` (false in practice).
            attention_bias=arch == "Qwen2ForCausalLM" or bool(text.get("attention_bias", False)),
            qk_norm=arch in _QK_NORM_ARCHITECTURES,
            torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype") or raw.get("dtype")
                            or "bfloat16"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            quantization=quant,
            **(vl_fields(raw, text, rotary_dim, arch, source) if arch in VL_ARCHITECTURES else {}),
            **hybrid,
            **moe,
        )
        check_moe_weights(cfg, source)
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
        model_type = "qwen2" if self.architecture == "Qwen2ForCausalLM" else "qwen3"
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
        if self.architecture in HYBRID_ARCHITECTURES:
            out = hybrid_hf_dict(self, out)
        else:
            if model_type == "qwen3":
                out["attention_bias"] = self.attention_bias
            if self.quantization is not None:
                out["quantization_config"] = self.quantization.to_hf_dict()
            if self.is_multimodal:
                out = self._vl_hf_dict(out)
        return moe_hf_dict(self, out) if self.architecture in MOE_ARCHITECTURES else out

    def _vl_hf_dict(self, flat: dict[str, Any]) -> dict[str, Any]:
        """Qwen3-VL's layout: decoder fields under text_config (rope settings in rope_parameters, as transformers 5
        writes them), the vision_config as given, ids and the tie flag at the top."""
        text = {k: v for k, v in flat.items()
                if k not in ("architectures", "model_type", "rope_theta", "tie_word_embeddings", "use_sliding_window",
                             "quantization_config")}
        text["model_type"] = "qwen3_vl_text"
        text["attention_bias"] = self.attention_bias
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                   "mrope_section": list(self.mrope_section or (24, 20, 20)), "mrope_interleaved": True}
        out: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": "qwen3_vl", "text_config": text,
            "vision_config": dict(self.vision_config or {}), "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id, "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id, "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype, "eos_token_id": flat["eos_token_id"],
        }
        if "quantization_config" in flat:
            out["quantization_config"] = flat["quantization_config"]
        return out


def _rope_theta(text: dict[str, Any], default: float = 10_000.0) -> float:
    # transformers 5 moved rope_theta into rope_parameters; older configs keep it top level.
    params = text.get("rope_parameters") or {}
    return params.get("rope_theta", text.get("rope_theta", default))


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
    # Qwen/Qwen3-VL-8B-Instruct's decoder (text_config) and M-RoPE split; the vision tower is SigLIP-2 shaped
    # (27 blocks of width 1152, 16 heads, DeepStack taps after blocks 8, 16 and 24, merger out 4096).
    "qwen3-vl-8b": dict(architecture=VL_ARCHITECTURE, vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=262144, rope_theta=5_000_000.0, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, eos_token_id=[151645, 151643], mrope_section=(24, 20, 20),
                        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                        vision_end_token_id=151653,
                        vision_config=dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh",
                                           intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096,
                                           num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])),
}


def _qwen3_5(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, value_heads: int, tied: bool
             ) -> dict[str, Any]:
    """A Qwen3.5 dense decoder's preset (text only, no MTP head): the family's fixed parts (head_dim 256, a quarter
    of it rotary, three linear-attention layers per full-attention one, 16 key heads of 128) around the sizes."""
    text = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=value_heads, rope_parameters={
                    "partial_rotary_factor": 0.25})
    return dict(architecture="Qwen3_5ForCausalLM", vocab_size=248320, hidden_size=hidden,
                intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=256, max_position_embeddings=262144, rope_theta=10_000_000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=tied, eos_token_id=[248046, 248044], qk_norm=True,
                **hybrid_fields(text, "preset"))


# Qwen/Qwen3.5-27B and Qwen/Qwen3.5-0.8B (config.json in tests/data/real-qwen): their decoders.
PRESETS["qwen3.5-27b"] = _qwen3_5(5120, 17408, 64, 24, 4, 48, tied=False)
PRESETS["qwen3.5-0.8b"] = _qwen3_5(1024, 3584, 24, 8, 2, 16, tied=True)
# Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 per token, every layer sparse (no shared expert).
PRESETS["qwen3-30b-a3b"] = dict(
    architecture=QWEN3_MOE_ARCHITECTURE, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=[151645, 151643],
    qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
# Qwen/Qwen3.5-35B-A3B's decoder: 256 experts of width 512, 8 per token, and a shared expert of 512 in every layer.
PRESETS["qwen3.5-35b-a3b"] = dict(
    _qwen3_5(2048, 0, 40, 16, 2, 32, tied=False), architecture=QWEN3_5_MOE_ARCHITECTURE, num_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True)

# Qwen/Qwen3.5-122B-A10B's decoder: 256 experts of width 1024, 8 per token, a shared expert of 1024; 244 GB in bf16,
# so it needs tensor parallelism over 4 80 GB GPUs.
PRESETS["qwen3.5-122b-a10b"] = dict(
    _qwen3_5(3072, 0, 48, 32, 2, 64, tied=False), architecture=QWEN3_5_MOE_ARCHITECTURE, num_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=1024, shared_expert_intermediate_size=1024, norm_topk_prob=True)


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a published checkpoint's shapes, e.g. `preset("qwen3-8b")`."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    fields = dict(PRESETS[name])
    arch = fields["architecture"]
    fields.setdefault("attention_bias", arch == "Qwen2ForCausalLM")
    fields.setdefault("qk_norm", arch in ("Qwen3ForCausalLM", VL_ARCHITECTURE))
    if fields.get("vision_config") is not None:
        fields["vision_config"] = dict(fields["vision_config"])  # callers may edit theirs: never share the preset's
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
