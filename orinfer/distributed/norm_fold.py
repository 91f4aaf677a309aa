"""A block's all-reduce deferred into the RMSNorm that adds the block's output to the residual stream.

Under tensor parallelism the attention and MLP blocks end in row-parallel linears: their outputs are partial sums,
all-reduced by a forward hook (sharding.install_reduce_hooks), and the reduced output goes straight into an RMSNorm
called as `norm(hidden, residual)`. With the Lamport all-reduce (the default on GPUs) one kernel can do both
(`group.all_reduce_add_rms_norm`: sum the partials, add the residual, normalise), saving a launch and a round trip
of the row per block. The model says where that holds, in neutral terms, as it declares `norm_consumers` for
layers/decode_hooks.py:

  residual_norms  {block: norm} on a module (a decoder layer): in its forward, the block's output goes only into
                  that norm, always with the residual
  layer_stream    on a model: {"layers", "block", "next_norm", "last_norm", "reader"}: layer i's `block` output goes
                  only into layer i + 1's `next_norm` with the residual, the last layer's into the model's
                  `last_norm`, unless the model's forward is given the keyword `reader` (a hook that reads the stream
                  between layers, e.g. Qwen3-VL's deepstack: it must see the reduced stream)

A block named in the plan's reduce_outputs whose output such a norm consumes then gets, instead of the all-reduce
hook, one that hands its partial output to the norm (`NormFold.pending`); the norm's `input_fold` reduces it: fused
with the add and the norm where the kernel takes it, else the all-reduce alone and the norm as before (no residual,
a consumer fed words, a row too large). A stream edge defers only while the model's forward runs without `reader`;
otherwise, and outside the forward, the block reduces its output itself as before. Every rank runs the same forward,
so every rank makes the same choices and calls the same collectives.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from orinfer.distributed.group import all_reduce, all_reduce_add_rms_norm


class NormFold:
    """An RMSNorm's `input_fold`: the partial waiting for it, reduced when the norm gets it."""

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None

    def __call__(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        pending, self.pending = self.pending, None
        if pending is not x:
            return None  # nothing deferred for this x (a partial left by a forward that raised is dropped)
        if residual is None or norm.feeds_words(x):
            all_reduce(x)
            return None
        return all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps, norm.ops.rms_norm)


class _Stream:
    """Whether a model's layer-to-layer deferrals hold now: inside its forward, without the reader keyword."""

    def __init__(self, reader: str) -> None:
        self.reader, self.open = reader, False

    def enter(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.open = kwargs.get(self.reader) is None

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.open = False


def _deferring_hook(fold: NormFold, stream: _Stream | None):
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if stream is not None and not stream.open:
            return all_reduce(output)
        fold.pending = output
        return output
    return hook


def install_norm_folds(model: nn.Module, reduced: set[str], whole: set[str]) -> set[nn.Module]:
    """Defers the all-reduce of every block named in `reduced` (plan["reduce_outputs"]) whose output a norm consumes
    as the model declares (module docstring), outside the `whole` submodules; returns those blocks (they must not
    get the all-reduce hook too)."""
    deferred: set[nn.Module] = set()

    def defer(block: nn.Module, norm: nn.Module, stream: _Stream | None = None) -> None:
        if norm.input_fold is None:
            norm.input_fold = NormFold()
        block.register_forward_hook(_deferring_hook(norm.input_fold, stream))
        deferred.add(block)

    for name, module in model.named_modules():
        if whole.intersection(name.split(".")):
            continue
        for block_name, norm_name in getattr(module, "residual_norms", {}).items():
            block = getattr(module, block_name, None)
            if block is not None and block_name in reduced:
                defer(block, module.get_submodule(norm_name))
        flow = getattr(module, "layer_stream", None)
        if flow is not None and flow["block"] in reduced:
            stream = _Stream(flow["reader"])
            module.register_forward_pre_hook(stream.enter, with_kwargs=True)
            module.register_forward_hook(stream.leave, always_call=True)
            layers = list(module.get_submodule(flow["layers"]))
            norms = [layer.get_submodule(flow["next_norm"]) for layer in layers[1:]]
            for layer, norm in zip(layers, norms + [module.get_submodule(flow["last_norm"])]):
                defer(layer.get_submodule(flow["block"]), norm, stream)
    return deferred
