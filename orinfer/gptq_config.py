"""GPTQ quantization settings (`quant_method: "gptq"`, AutoGPTQ / GPTQModel / optimum's classic checkpoint format).

Per linear with K inputs, N outputs, b bits (4 or 8), P = 32 / b values per int32, group size G (-1: one group):
`qweight` int32 [K / P, N] (value of input k in bits b*(k % P).. of row k // P), `qzeros` int32 [groups, N / P]
(output n in bits b*(n % P).. of column n // P), `scales` fp16 [groups, N], `g_idx` int32 [K] (the group of each
input; with desc_act a permutation of k // G), groups = ceil(K / G). The classic format stores zero - 1, so
W[n, k] = (q[k, n] - (z[g_idx[k], n] + 1)) * scales[g_idx[k], n]. Only symmetric quantization (zero = 2^(b-1)) is
read: in that format an asymmetric zero of 0 cannot be stored (the famous off-by-one that gptq_v2 fixed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orinfer.errors import ConfigError
from orinfer.quant_fields import group_size_field, module_list_field

if TYPE_CHECKING:
    from orinfer.config import ModelConfig

_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class GPTQConfig:
    """Symmetric GPTQ with `bits` 4 or 8, groups of `group_size` inputs (-1: one), act-order (`desc_act`) or not."""

    method: str = "gptq"
    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"
    modules_to_not_convert: tuple[str, ...] = ()

    @property
    def pack_factor(self) -> int:
        """Values per int32."""
        return 32 // self.bits

    def group_for(self, in_features: int) -> int:
        """The group size of a linear with `in_features` inputs (-1: one group)."""
        return in_features if self.group_size == -1 else self.group_size

    def num_groups(self, in_features: int) -> int:
        g = self.group_for(in_features)
        return -(-in_features // g)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config") -> "GPTQConfig":
        """Parses a `quantization_config` with quant_method "gptq"; ConfigError names any unsupported field."""
        where = f"{source}: quantization_config"
        bits = raw.get("bits", 4)
        if isinstance(bits, bool) or bits not in (4, 8):
            raise ConfigError(f"{where}: bits={bits!r} is not supported; orinfer reads 4- and 8-bit GPTQ")
        group = group_size_field(raw, where, "group_size")
        sym = raw.get("sym", True)
        if sym is not True:
            raise ConfigError(f"{where}: sym={sym!r} is not supported; orinfer reads symmetric GPTQ (the classic "
                              "format cannot store an asymmetric zero point of 0)")
        desc_act = raw.get("desc_act", False)
        if not isinstance(desc_act, bool):
            raise ConfigError(f"{where}: desc_act={desc_act!r} must be true or false")
        fmt = raw.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise ConfigError(f"{where}: checkpoint_format {fmt!r} is not supported; orinfer reads the classic "
                              "'gptq' layout (stored zero points are zero - 1)")
        if raw.get("lm_head", False):
            raise ConfigError(f"{where}: lm_head=true is not supported; orinfer needs a 16-bit lm_head")
        if raw.get("dynamic"):
            raise ConfigError(f"{where}: dynamic (per-module overrides) is not supported")
        skip = module_list_field(raw, where)
        return cls(bits=bits, group_size=group, desc_act=desc_act, modules_to_not_convert=tuple(skip))

    def check_model(self, cfg: "ModelConfig", source: str = "config") -> None:
        """Every decoder linear is GPTQ and its in/out features fit the int32 packing (multiples of 32 / bits)."""
        where = f"{source}: quantization_config"
        for name in self.modules_to_not_convert:
            if name.rsplit(".", 1)[-1] in _DECODER_LINEARS:
                raise ConfigError(f"{where}: modules_to_not_convert lists {name!r}; orinfer needs every decoder "
                                  "linear quantized")
        p = self.pack_factor
        shapes = {"q_proj": (cfg.hidden_size, cfg.q_size), "k_proj": (cfg.hidden_size, cfg.kv_size),
                  "o_proj": (cfg.q_size, cfg.hidden_size), "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
                  "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
        for name, (fin, fout) in shapes.items():
            for what, size in (("in_features", fin), ("out_features", fout)):
                if size % p:
                    raise ConfigError(f"{where}: {name}'s {what}={size} is not a multiple of {p}, which "
                                      f"{self.bits}-bit GPTQ's int32 packing needs")

    def check_loadable(self, cfg: "ModelConfig") -> None:
        """Everything check_model accepts loads."""

    def to_hf_dict(self) -> dict[str, Any]:
        """The `quantization_config` GPTQ tools write (the fields orinfer reads)."""
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "checkpoint_format": self.checkpoint_format}
