"""Maps a checkpoint's `architectures` entry to the class that builds it; the runner only sees this table."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from orinfer.config import SUPPORTED_ARCHITECTURES, ModelConfig
from orinfer.distributed.group import current as current_group, lamport_enabled
from orinfer.distributed.sharding import install_reduce_hooks
from orinfer.errors import ConfigError
from orinfer.layers.ops import Ops

# architecture -> "module:Class". Imported on first use, so that `import orinfer` does not pay for (or depend on)
# the vision tower of a family the user never loads.
MODEL_CLASSES: dict[str, str] = {
    "Qwen2ForCausalLM": "orinfer.models.qwen:QwenForCausalLM",
    "Qwen3ForCausalLM": "orinfer.models.qwen:QwenForCausalLM",
    "Qwen3VLForConditionalGeneration": "orinfer.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    "Qwen3_5ForCausalLM": "orinfer.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "orinfer.models.qwen3_5_vl:Qwen3_5ForConditionalGeneration",
    # Mixture-of-experts variants: the same classes; each decoder layer builds its feed-forward from the config
    # (models/qwen.py: make_mlp).
    "Qwen3MoeForCausalLM": "orinfer.models.qwen:QwenForCausalLM",
    "Qwen3VLMoeForConditionalGeneration": "orinfer.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    "Qwen3_5MoeForCausalLM": "orinfer.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "orinfer.models.qwen3_5_vl:Qwen3_5ForConditionalGeneration",
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)


def model_class(architecture: str) -> type[nn.Module]:
    """The nn.Module class that implements `architecture`; ConfigError if none does."""
    target = MODEL_CLASSES.get(architecture)
    if target is None:
        raise ConfigError(f"unsupported architecture {architecture}; supported: {', '.join(MODEL_CLASSES)}")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def build_model(cfg: ModelConfig, ops: Ops, weight_dtype: torch.dtype, act_dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    """Instantiates the model for `cfg.architecture` with uninitialised weights directly on `device`, with the
    backend's decode-only hooks installed (`Ops.install_hooks`)."""
    cls = model_class(cfg.architecture)
    with torch.device(device):
        model = cls(cfg, ops, weight_dtype, act_dtype)
    if current_group().enabled:  # tensor parallelism: `cfg` is this rank's shard (distributed/sharding.py)
        install_reduce_hooks(model, cls.tensor_parallel_plan, fold_norms=lamport_enabled(device))
    if ops.install_hooks is not None:
        ops.install_hooks(model)
    return model.eval()
