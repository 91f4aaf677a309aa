"""The drafter's weight format (speculative_config "quantization", vLLM's key): "fp8" drafts from block-wise FP8.

A proposal reads the drafter's weights k times per verify step: at Qwen3.5-27B each MTP draft step reads the target's
16-bit LM head (248320 x 5120, 2.5 GB) and the head's decoder layer (~0.85 GB). Drafts only change speed, never the
output: verification decides every token, and the drafts are argmaxes (one-hot proposals), so the verify step's
rule holds whatever logits chose them (spec_decode/verify.py). So the drafter may read FP8 weights, half the bytes,
through the linear types and kernels of FP8 checkpoints:

- method "mtp": the MTP head's linears (fc, its decoder layer's attention and MLP / experts) are built in online FP8
  (`ModelConfig.mtp_quantization`, models/qwen3_5_mtp.py) and quantized as they load, so their 16-bit copies are
  never held (`target_config`); a target already quantized keeps its head as it is (an FP8 release's head layers
  are FP8 already; its fc stays 16-bit, as stored);
- method "draft_model": the draft model loads with `--quantization fp8`'s online FP8 (`draft_config`), unless its
  checkpoint is quantized already;
- both: the drafts' logits come from a block-FP8 copy of the LM head (a `LinearHead`: the one-row FP8 GEMV at
  batch 1, the small-M path for more rows, dequantised by the torch backend), vocab x hidden bytes more (1.27 GB at
  Qwen3.5-27B). The MTP proposer computes its drafts' logits with it (`mtp_draft_head`) while the target's own steps
  and the verify step keep the 16-bit head; a draft model's head is replaced by it (`use_draft_head`: its runner,
  graphs and warm-ups then run it; a tied embedding stays 16-bit, an untied 16-bit head is freed).
Loading applies the configs (LLM, the bench's random weights); the engine makes the heads (LLMEngine). Under tensor
parallelism EngineArgs refuses method mtp with a quantization (a draft model runs whole on rank 0: supported).
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from orinfer.config import ModelConfig
from orinfer.errors import ConfigError
from orinfer.layers.embedding import LinearHead, LMHead
from orinfer.layers.linear_types import quantized_head
from orinfer.loader import online_format, online_quantization
from orinfer.spec_decode.config import SpeculativeConfig

log = logging.getLogger(__name__)


def target_config(spec: SpeculativeConfig | None, cfg: ModelConfig) -> ModelConfig:
    """The target's config with its MTP head in the drafter's format (method mtp with a quantization, a 16/32-bit
    target or one quantized online as a whole); `cfg` unchanged otherwise."""
    if spec is None or spec.method != "mtp" or spec.quantization is None or not cfg.mtp_num_hidden_layers:
        return cfg
    if cfg.quantization is not None and not getattr(cfg.quantization, "online", False):
        log.info("speculative decoding: the MTP head keeps the checkpoint's %s weights; its drafts' logits use an %s "
                 "copy of the LM head", cfg.quantization.method, spec.quantization)
        return cfg
    return dataclasses.replace(cfg, mtp_quantization=online_format(spec.quantization))


def draft_config(spec: SpeculativeConfig | None, cfg: ModelConfig, source: str = "draft model") -> ModelConfig:
    """The draft model's config in the drafter's format (method draft_model with a quantization, a 16/32-bit draft
    checkpoint); `cfg` unchanged otherwise."""
    if spec is None or spec.method != "draft_model" or spec.quantization is None or cfg.quantization is not None:
        return cfg
    return online_quantization(cfg, spec.quantization, source)


def lm_head(model: nn.Module) -> LMHead:
    """The model's LM head (the one LMHead among its modules)."""
    heads = [module for module in model.modules() if isinstance(module, LMHead)]
    if len(heads) != 1:
        raise ConfigError(f"speculative_config: quantization needs a model with one LM head, "
                          f"{type(model).__name__} has {len(heads)}")
    return heads[0]


def mtp_draft_head(spec: SpeculativeConfig | None, target: nn.Module) -> LinearHead | None:
    """The MTP drafts' LM head: a copy of the target's in the drafter's format (method mtp with a quantization), else
    None (the drafts use the target's head)."""
    if spec is None or spec.method != "mtp" or spec.quantization is None:
        return None
    return quantized_head(online_format(spec.quantization), lm_head(target))


def use_draft_head(spec: SpeculativeConfig | None, draft: nn.Module) -> None:
    """Replaces the draft model's LM head by a copy in the drafter's format (method draft_model with a quantization;
    nothing otherwise)."""
    if spec is None or spec.method != "draft_model" or spec.quantization is None:
        return
    head = lm_head(draft)
    name = next(name for name, module in draft.named_modules() if module is head)
    parent, _, attribute = name.rpartition(".")
    setattr(draft.get_submodule(parent), attribute, quantized_head(online_format(spec.quantization), head))
