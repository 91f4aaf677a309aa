"""VisionConfig: the Qwen3-VL vision tower's shapes, parsed and validated from config.json's `vision_config`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from orinfer.errors import ConfigError

# hidden_act -> torch's GELU `approximate`. gelu_new is the same tanh formula as gelu_pytorch_tanh; other
# variants (gelu_fast, quick_gelu, ...) are different curves that no Qwen3-VL checkpoint uses.
_GELU_VARIANTS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none", "gelu_python": "none"}
_REQUIRED = object()


@dataclass(frozen=True)
class VisionConfig:
    """Shapes of the vision tower (HF's Qwen3VLVisionConfig). Validated on construction (ConfigError)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6  # fixed in HF's model code, not read from the config

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: in_channels * temporal_patch_size * patch_size**2 (one row of pixel_values)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches fused into one output token (spatial_merge_size**2)."""
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def pos_side(self) -> int:
        """Side of the square learned position grid."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def gelu_approximate(self) -> str:
        """torch's `approximate` argument for the blocks' activation ("tanh" or "none")."""
        return _GELU_VARIANTS[self.hidden_act]

    def validate(self) -> None:
        """Raises ConfigError naming the first field the tower cannot run with."""
        source = "vision_config"
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                     "num_position_embeddings", "in_channels", "patch_size", "spatial_merge_size",
                     "temporal_patch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{source}: {name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"{source}: hidden_size={self.hidden_size} is not a multiple of "
                              f"num_heads={self.num_heads}")
        if self.head_dim % 4:
            # The 2D rotary splits each head's rotated half evenly between the row and the column angle.
            raise ConfigError(f"{source}: head_dim={self.head_dim} (hidden_size / num_heads) must be a multiple of 4 "
                              "for the 2D rotary embedding")
        if self.pos_side ** 2 != self.num_position_embeddings:
            raise ConfigError(f"{source}: num_position_embeddings={self.num_position_embeddings} must be a perfect "
                              "square (the learned table is a square grid)")
        if self.hidden_act not in _GELU_VARIANTS:
            raise ConfigError(f"{source}: hidden_act={self.hidden_act!r} is not supported; use one of "
                              f"{', '.join(sorted(_GELU_VARIANTS))}")
        indexes = self.deepstack_visual_indexes
        if not isinstance(indexes, tuple) or any(isinstance(i, bool) or not isinstance(i, int) for i in indexes):
            raise ConfigError(f"{source}: deepstack_visual_indexes={indexes!r} must be a list of integers")
        if any(i < 0 or i >= self.depth for i in indexes) or list(indexes) != sorted(set(indexes)):
            raise ConfigError(f"{source}: deepstack_visual_indexes={list(indexes)} must be strictly increasing block "
                              f"indexes in [0, depth={self.depth})")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 0:
            raise ConfigError(f"{source}: rope_theta={self.rope_theta!r} must be a positive number")
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"{source}: layer_norm_eps={self.layer_norm_eps!r} must be positive")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "VisionConfig":
        """Parses HF's `vision_config` dict; a missing or invalid field raises ConfigError naming it."""
        source = "vision_config"
        if not isinstance(d, dict):
            raise ConfigError(f"{source} must be a JSON object, got {type(d).__name__}")

        def get(name: str, default: Any = _REQUIRED, alias: str | None = None) -> Any:
            if name in d:
                return d[name]
            if alias is not None and alias in d:
                return d[alias]
            if default is _REQUIRED:
                raise ConfigError(f"{source}: missing required field {name!r}")
            return default

        indexes = get("deepstack_visual_indexes")
        if not isinstance(indexes, (list, tuple)):
            raise ConfigError(f"{source}: deepstack_visual_indexes={indexes!r} must be a list of integers")
        hidden_act = get("hidden_act", "gelu_pytorch_tanh")
        if not isinstance(hidden_act, str):
            raise ConfigError(f"{source}: hidden_act={hidden_act!r} must be a string")
        for name in ("patch_size", "temporal_patch_size"):  # HF's types allow a list; its Conv3d does not
            if isinstance(d.get(name), (list, tuple)):
                raise ConfigError(f"{source}: {name}={d[name]!r} must be a single positive integer")
        return cls(
            depth=get("depth"), hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
            num_heads=get("num_heads", alias="num_attention_heads"), out_hidden_size=get("out_hidden_size"),
            num_position_embeddings=get("num_position_embeddings"), deepstack_visual_indexes=tuple(indexes),
            in_channels=get("in_channels", 3), patch_size=get("patch_size"),
            spatial_merge_size=get("spatial_merge_size"), temporal_patch_size=get("temporal_patch_size"),
            hidden_act=hidden_act, rope_theta=_rope_theta(d, source),
        )


def _rope_theta(d: dict[str, Any], source: str) -> float:
    """rope_parameters.rope_theta (HF >= 5), else a legacy top-level rope_theta, else HF's default 10000."""
    params = d.get("rope_parameters")
    if params is None:
        return d.get("rope_theta", 10000.0)
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters must be a JSON object, got {type(params).__name__}")
    rope_type = params.get("rope_type", "axial")
    if rope_type != "axial":
        raise ConfigError(f"{source}: rope_parameters.rope_type={rope_type!r} is not supported; the vision tower uses "
                          "axial 2D rotary embeddings")
    return params.get("rope_theta", d.get("rope_theta", 10000.0))


# Qwen/Qwen3-VL-8B-Instruct's published vision_config (rope theta and hidden_act are HF's defaults).
QWEN3_VL_8B_VISION = VisionConfig(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
    num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24), in_channels=3, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0)
