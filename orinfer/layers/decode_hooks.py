"""Decode-only tricks of a backend (and activation feeding, for any row count), wired into a model from the structure
the model declares.

A model file says, in neutral terms, how its layers connect; it does nothing with that itself:

  norm_consumers      {norm attribute: linear attribute path}: the linear that reads each RMSNorm's output
  swiglu_consumers    {packed gate|up linear attribute: linear attribute path}: the linear that reads its SwiGLU
  attention_section   (opening linear, closing linear): the projections around a memory-light stretch of a decode
                      step (QK-norm, RoPE, KV store, attention move a few MB while the next weights wait)

`install_decode_hooks(model)` (the triton backend's `Ops.install_hooks`, run by `models.registry.build_model`) turns
that into:
  - norm feeding: each such RMSNorm knows its consumer, and hands it int16 words instead of the normed row when the
    consumer takes them (batch-1 AWQ decode, `kernels/w4_words.py`), or the row quantized for W8A8 (FP8 linears,
    `kernels/fp8_feed.py`);
  - SwiGLU feeding: each such gate|up knows its consumer, and hands it the SwiGLU quantized when it takes that (FP8);
  - L2 prefetch: after an opening linear, the closing linear's weights and the first NEXT_SECTION_PREFETCH of the next
    section's opening linear are requested into L2 from a side stream (`kernels/l2_prefetch.py`; a no-op outside the
    decode graphs' capture).
"""

from __future__ import annotations

import torch
from torch import nn

# The share of the next attention section's opening weights (the next layer's qkv rows) prefetched during a section.
# Batch-1 AWQ step replay on the H200: none 1.749 ms, 25% 1.738, 40% 1.735, 50% 1.739, all of it 1.748
# (docs/performance.md, "L2 prefetch").
NEXT_SECTION_PREFETCH = 0.4
# Steps of more rows prefetch nothing: their attention streams the whole batch's KV, so the section is not memory-light
# and the prefetch competes with it. Qwen3-8B at TP2 (whose 16.7 MB o is under the plans' cap), batch 64: decode
# attention 27.7 -> 23.8 us a layer in the step (the kernel alone: 21.9), NOTES runs 423 and 427.
PREFETCH_MAX_ROWS = 16


def install_decode_hooks(model: nn.Module) -> None:
    """Wires norm feeding and the L2 prefetch into `model` (idempotent)."""
    if getattr(model, "_decode_hooks_installed", False):
        return
    sections: list[tuple[nn.Module, nn.Module]] = []
    for module in model.modules():
        for table in ("norm_consumers", "swiglu_consumers"):
            for producer, linear_path in getattr(module, table, {}).items():
                # a list: not registered as a submodule
                module.get_submodule(producer).consumer = [module.get_submodule(linear_path)]
        section = getattr(module, "attention_section", None)
        if section is not None:
            sections.append((module.get_submodule(section[0]), module.get_submodule(section[1])))
    for index, (opening, closing) in enumerate(sections):
        following = sections[index + 1][0] if index + 1 < len(sections) else None
        opening.register_forward_hook(_prefetch_hook(closing, following))
    model._decode_hooks_installed = True


def _prefetch_hook(closing: nn.Module, following: nn.Module | None):
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        prefetch = module.ops.prefetch_weights
        if prefetch is not None and output.shape[0] <= PREFETCH_MAX_ROWS:
            prefetch(closing)
            if following is not None:
                prefetch(following, NEXT_SECTION_PREFETCH)
    return hook
