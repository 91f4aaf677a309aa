"""Maps a checkpoint's `architectures` entry to the class that builds it; the runner only sees this table."""

from __future__ import annotations

import torch
from torch import nn

from orinfer.config import SUPPORTED_ARCHITECTURES, ModelConfig
from orinfer.errors import ConfigError
from orinfer.layers.ops import Ops
from orinfer.models.qwen import QwenForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "Qwen2ForCausalLM": QwenForCausalLM,
    "Qwen3ForCausalLM": QwenForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)


def build_model(cfg: ModelConfig, ops: Ops, weight_dtype: torch.dtype, act_dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    """Instantiates the model for `cfg.architecture` with uninitialised weights directly on `device`."""
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ConfigError(f"unsupported architecture {cfg.architecture}; supported: {', '.join(MODEL_CLASSES)}")
    with torch.device(device):
        model = cls(cfg, ops, weight_dtype, act_dtype)
    return model.eval()
