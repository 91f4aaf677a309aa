"""FP8 block-wise quantization settings (`quant_method: "fp8"`, the format of Qwen's *-FP8 releases).

Each quantized linear W [N, K] is stored as `weight` float8_e4m3fn [N, K] and `weight_scale_inv` float32
[ceil(N / bn), ceil(K / bk)] for `weight_block_size` [bn, bk] (Qwen: [128, 128]); despite its name the scale is the
multiplier: W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]. Edge blocks of shapes that do not divide
are partial. Activations are quantized per call ("dynamic"): orinfer runs W8A8 where it pays (prefill, decode
batches of 3+ rows) as other engines do, and W8A16 for one or two rows; ORINFER_FP8_ACTIVATIONS=16bit keeps x in 16
bits everywhere (`ACTIVATIONS`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orinfer.errors import ConfigError
from orinfer.quant_fields import module_list_field

if TYPE_CHECKING:
    from orinfer.config import ModelConfig

# Decoder linears that must be FP8 in an FP8 model (a modules_to_not_convert entry naming one is refused). Qwen3.5's
# in_proj_a / in_proj_b may stay 16-bit: they are the last shards of the packed in_proj (`dense_shards`).
_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                    "in_proj_z", "out_proj", "experts")
# What online FP8 (`--quantization fp8`) leaves 16-bit, as Qwen's FP8 releases do (Qwen3.6-27B-FP8 lists them in
# modules_to_not_convert): Qwen3.5's per-value-head gate inputs, a few dozen rows each (less than one 128-row block,
# where FP8 saves nothing). Under tensor parallelism a rank's share of them would also make blocks of its own, with
# scales unlike the single process's.
ONLINE_16_BIT = ("in_proj_a", "in_proj_b")
# Whether FP8 layers quantize their activations: "dynamic" (the default) per token and 128-group where W8A8 pays,
# as the checkpoints declare and other engines run them; "16bit": never (W8A16 everywhere: the logits of the 16-bit
# model of the dequantised weights, at a slower prefill and slower decode batches; benchmarks/NOTES.md run 460-461).
# It sets the defaults of ORINFER_FP8_SMALL_M, ORINFER_FP8_PREFILL (kernels/fp8_ops.py) and ORINFER_FP8_EXPERTS
# (kernels/moe_a8.py), which the kernels read at import; an FP8 layer refuses any other value when it is built.
ACTIVATIONS = os.environ.get("ORINFER_FP8_ACTIVATIONS", "dynamic")


def check_activations_setting() -> None:
    """ConfigError naming ORINFER_FP8_ACTIVATIONS when it holds neither of its values."""
    if ACTIVATIONS not in ("dynamic", "16bit"):
        raise ConfigError(f"ORINFER_FP8_ACTIVATIONS={ACTIVATIONS!r}: expected 'dynamic' (the default) or '16bit'")


@dataclass(frozen=True)
class FP8Config:
    """Block-wise FP8 (e4m3) weights with fp32 block scales. `online`: the checkpoint is 16-bit and orinfer quantizes
    it to this format while loading (`--quantization fp8`); it is never written to config.json."""

    method: str = "fp8"
    block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()
    online: bool = False

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config") -> "FP8Config":
        """Parses a `quantization_config` with quant_method "fp8"; ConfigError names any unsupported field."""
        where = f"{source}: quantization_config"
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"{where}: fmt {fmt!r} is not supported; orinfer reads e4m3 FP8 weights")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ConfigError(f"{where}: activation_scheme {scheme!r} is not supported; orinfer reads FP8 "
                              "checkpoints with dynamic activation scaling (no stored input_scale)")
        for flag in ("weight_per_tensor", "act_per_tensor"):
            if raw.get(flag, False):
                raise ConfigError(f"{where}: {flag}={raw[flag]!r} is not supported; orinfer reads block-wise FP8")
        block = raw.get("weight_block_size")
        if block is None:
            raise ConfigError(f"{where}: weight_block_size is missing; orinfer reads block-wise FP8 (e.g. "
                              "[128, 128]), not per-tensor FP8")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError(f"{where}: weight_block_size={block!r} must be two positive integers [rows, cols]")
        skip = module_list_field(raw, where)
        return cls(block_size=(block[0], block[1]), activation_scheme=scheme, modules_to_not_convert=tuple(skip))

    def check_model(self, cfg: "ModelConfig", source: str = "config") -> None:
        """Every decoder linear must be FP8 but Qwen3.5's in_proj_a / in_proj_b (a 16-bit one in modules_to_not_convert
        is refused), routed experts included; an MoE layer's router (`mlp.gate`) and shared-expert gate are 16-bit
        whatever the list says (layers/moe.py)."""
        for name in self.modules_to_not_convert:
            if name.rsplit(".", 1)[-1] in _DECODER_LINEARS:
                raise ConfigError(f"{source}: quantization_config: modules_to_not_convert lists {name!r}; orinfer "
                                  "needs every decoder linear of an FP8 model in FP8")

    def check_loadable(self, cfg: "ModelConfig") -> None:
        """Everything check_model accepts loads."""

    def dense_shards(self, checkpoint_names: dict[object, str]) -> tuple[object, ...]:
        """The shards of a packed layer (shard id -> checkpoint sub-name, e.g. "a" -> "in_proj_a") that
        modules_to_not_convert keeps 16-bit. The lists name every layer's module; a sub-name listed for any layer
        is taken for all (a layer that has it in FP8 then fails to load with a clear error). Online FP8 keeps
        ONLINE_16_BIT so."""
        listed = {name.rsplit(".", 1)[-1] for name in self.modules_to_not_convert}
        if self.online:
            listed.update(ONLINE_16_BIT)
        return tuple(shard for shard, sub in checkpoint_names.items() if sub in listed)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `quantization_config` Qwen's FP8 releases carry."""
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": self.activation_scheme,
                               "weight_block_size": list(self.block_size)}
        if self.modules_to_not_convert:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return out


# The random FP8 models of `orinfer bench --synthetic ... --quant fp8` (and the tools built on them) keep
# ONLINE_16_BIT 16-bit as the releases do: otherwise the packed in_proj's 32-row b / a shards would split its 128-row
# blocks and take paths (a row -> scale-row map, dequantised prefill) that no released checkpoint takes (NOTES run 464).
SYNTHETIC_FP8 = FP8Config(modules_to_not_convert=ONLINE_16_BIT)
