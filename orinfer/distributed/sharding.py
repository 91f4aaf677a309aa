"""How tensor parallelism splits a model: the per-rank config, the checkpoint slice each rank reads, the all-reduces.

A model class declares its split as data, `tensor_parallel_plan` (a dict; models/qwen.py has one), naming checkpoint
sub-names ("q_proj") and submodules ("mlp") only:
  heads        split along the output rows by attention heads (column parallel)
  kv_heads     the same by KV heads; with fewer KV heads than ranks each head is replicated on world / kv ranks
  columns      split evenly along the output rows (column parallel: gate/up, each expert's too)
  rows         split evenly along the input columns (row parallel: o/down); each rank's output is a partial sum
  vocab        split along the vocabulary rows (embedding, lm_head: layers/embedding.py pads to world * ceil(V/world))
  reduce_outputs  submodules whose output is such a partial sum: their output is all-reduced (one per attention
               block and one per MLP or MoE block, whatever rows-split layers they hold)
Every other tensor (norms, routers, the shared-expert gate) is read whole by every rank.

With the heads and widths divided by the world size (`shard_config`), the model file builds each rank's layers at
their per-rank shapes unchanged, and the loader reads only the rank's slice of each tensor (`checkpoint_slicer`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from orinfer.config import ModelConfig
from orinfer.distributed.group import TensorParallelGroup, all_reduce
from orinfer.errors import ConfigError

# (dimension, first index, length) of the part of a checkpoint tensor a rank reads; None: the whole tensor.
Slice = tuple[int, int, int] | None
Slicer = Callable[[str, tuple[int, ...]], Slice]  # (checkpoint name, full shape) -> the rank's part


def check_supported(cfg: ModelConfig, world_size: int) -> None:
    """ConfigError naming what keeps `cfg` from running on `world_size` ranks."""
    if cfg.is_hybrid or cfg.is_multimodal:
        raise ConfigError(f"tensor_parallel_size {world_size}: {cfg.architecture} is not supported with tensor "
                          "parallelism yet (supported: Qwen2, Qwen3 and Qwen3-MoE text models)")
    if cfg.quantization is not None:
        raise ConfigError(f"tensor_parallel_size {world_size}: {cfg.quantization.method.upper()} weights are not "
                          "supported with tensor parallelism yet (16/32-bit checkpoints are)")
    widths = {"num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size,
              "moe_intermediate_size": cfg.moe_intermediate_size,
              "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size}
    for name, value in widths.items():
        if value % world_size:
            raise ConfigError(f"tensor_parallel_size {world_size} must divide the model's {name} ({value})")
    kv = cfg.num_key_value_heads
    if kv % world_size and world_size % kv:
        raise ConfigError(f"tensor_parallel_size {world_size} and the model's num_key_value_heads ({kv}) must "
                          "divide one another (fewer KV heads than ranks are replicated)")


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's shard: heads and MLP widths divided by the world size (at least one KV head)."""
    if world_size == 1:
        return cfg
    check_supported(cfg, world_size)
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // world_size,
        num_key_value_heads=max(1, cfg.num_key_value_heads // world_size),
        intermediate_size=cfg.intermediate_size // world_size,
        moe_intermediate_size=cfg.moe_intermediate_size // world_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // world_size)


def vocab_rows(vocab_size: int, world_size: int) -> int:
    """Rows of the embedding / lm_head each rank holds (the last rank's tail is padding)."""
    return -(-vocab_size // world_size)


def checkpoint_slicer(plan: dict[str, tuple[str, ...]], cfg: ModelConfig, group: TensorParallelGroup) -> Slicer:
    """(checkpoint name, full shape) -> the slice rank `group.rank` reads (see the module docstring). `cfg`: the
    full model's config."""
    rank, world = group.rank, group.world_size

    def even(shape: tuple[int, ...], dim: int) -> Slice:
        part = shape[dim] // world
        return dim, rank * part, part

    def by_kv_heads(shape: tuple[int, ...]) -> Slice:
        kv = cfg.num_key_value_heads
        head_rows = shape[0] // kv
        if kv >= world:
            return 0, rank * (kv // world) * head_rows, (kv // world) * head_rows
        return 0, (rank * kv // world) * head_rows, head_rows  # replicated: ranks share a head

    def slicer(name: str, shape: tuple[int, ...]) -> Slice:
        parts = name.split(".")
        if len(parts) < 2:
            return None
        module, kind = parts[-2], parts[-1]
        if module in plan.get("vocab", ()):
            rows = vocab_rows(shape[0], world)
            start = min(rank * rows, shape[0])
            return 0, start, min(rows, shape[0] - start)
        if module in plan.get("heads", ()) or module in plan.get("columns", ()):
            return even(shape, 0)
        if module in plan.get("kv_heads", ()):
            return by_kv_heads(shape)
        if module in plan.get("rows", ()):
            if kind != "weight":
                raise ConfigError(f"{name}: a row-parallel layer with a {kind} is not supported with tensor "
                                  "parallelism (each rank would add it)")
            return even(shape, 1)
        return None

    return slicer


def install_reduce_hooks(model: nn.Module, plan: dict[str, tuple[str, ...]]) -> None:
    """All-reduces the output of every submodule named in plan["reduce_outputs"] (a forward hook: module names, and
    so checkpoint names and the backends' decode hooks, stay as they are)."""
    names = set(plan.get("reduce_outputs", ()))
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in names:
            module.register_forward_hook(_reduce_output)


def _reduce_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return all_reduce(output)

