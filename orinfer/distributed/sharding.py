"""How tensor parallelism splits a model: the per-rank config, the checkpoint slice each rank reads, the all-reduces.

A model class declares its split as data, `tensor_parallel_plan` (a dict; models/qwen.py, qwen3_5.py and
qwen3_vl.py have one), naming checkpoint sub-names ("q_proj") and submodules ("mlp") only:
  heads        split along the output rows by attention heads (column parallel; a head's rows stay together, so
               Qwen3.5's q_proj, which emits each head's query then its gate, splits the same way)
  kv_heads     the same by KV heads; with fewer KV heads than ranks each head is replicated on world / kv ranks
  columns      split evenly along the output rows (column parallel: gate/up, each expert's too)
  rows         split evenly along the input columns (row parallel: o/down); each rank's output is a partial sum
  vocab        split along the vocabulary rows (embedding, lm_head: layers/embedding.py pads to world * ceil(V/world))
  parts        tensors packed from parts that each split by their own heads (a Gated DeltaNet's q | k | v): name ->
               ((heads, head width), ...), each a ModelConfig field's name or a number, in the order of the rows.
               A rank reads its heads of every part (along the format's output channels: slices.parts_slice) and
               the loader concatenates them, so the rank's tensor is packed like the whole one; a part with fewer
               heads than ranks is replicated as KV heads are. A name is a module's sub-name ("in_proj_qkv") or, for
               a block's own parameter, "block.param" ("linear_attn.A_log": never quantized).
  unquantized  modules that are 16-bit whatever the checkpoint's format: no linear (a conv), or a linear the model
               always builds 16-bit (Qwen3.5's MTP fc)
  fused_experts  modules holding every expert's FFN in two tensors (Qwen3-VL-MoE's checkpoints): gate_up_proj
               [E, 2I, H] and down_proj [E, H, I], or both transposed; split inside the experts as per-expert
               tensors are (`fused_expert_slice`)
  reduce_outputs  submodules whose output is such a partial sum: their output is all-reduced (one per attention
               block and one per MLP or MoE block, whatever rows-split layers they hold)
  whole        submodules read whole by every rank and never reduced (a vision tower, which rank 0 alone runs)
Every other tensor (norms, routers, the shared-expert gate) is read whole by every rank.

With the heads and widths divided by the world size (`shard_config`), the model file builds each rank's layers at
their per-rank shapes unchanged, and the loader reads only the rank's slice of each tensor (`checkpoint_slicer`).
Quantized checkpoints (AWQ, GPTQ, FP8, online FP8) split the same way: slices.py maps each format's tensors (packed
words, groups, scale blocks) to a rank's part, so that a rank's tensors are those of its smaller layer in the same
format; `check_supported` checks every split layer's parts before anything loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from orinfer.config import ModelConfig
from orinfer.distributed.group import TensorParallelGroup, all_reduce
from orinfer.distributed.norm_fold import install_norm_folds
from orinfer.distributed.slices import (PLAIN, Split, checkpoint_shapes, output_axis, parts_slice, stored_format,
                                        tensor_slice)
from orinfer.errors import ConfigError, WeightsError

# The part of a checkpoint tensor a rank reads: (dimension, first index, length), or a list of such ranges (along
# one dimension) whose parts are concatenated in order; None: the whole tensor.
Range = tuple[int, int, int]
# With a weight format's function to apply to the part once read (slices.py: GPTQ's g_idx renumbered).
# Or a part wrapped in the loader's `Then` (a function applied once read).
Slice = Range | list[Range] | tuple[int, int, int, Callable[[torch.Tensor], torch.Tensor]] | Any | None
Slicer = Callable[[str, tuple[int, ...]], Slice]  # (checkpoint name, full shape) -> the rank's part

# Heads that may be fewer than the ranks (each is then replicated): they are only read (attention's KV heads, the
# key heads the delta rule's value heads share). Every other head count and width must divide by the world size.
REPLICABLE_HEADS = ("num_key_value_heads", "linear_num_key_heads")
DIVIDED = ("num_attention_heads", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
           "linear_num_value_heads")


def check_supported(cfg: ModelConfig, world_size: int) -> None:
    """ConfigError naming what keeps `cfg` from running on `world_size` ranks."""
    from orinfer.models.registry import model_class  # the registry imports this module

    if getattr(model_class(cfg.architecture), "tensor_parallel_plan", None) is None:
        raise ConfigError(f"tensor_parallel_size {world_size}: {cfg.architecture} is not supported with tensor "
                          "parallelism yet (supported: Qwen2, Qwen3, Qwen3-MoE, Qwen3-VL and the Qwen3.5 family, "
                          "dense and MoE, text-only and with images)")
    for name in DIVIDED:
        value = getattr(cfg, name)
        if value % world_size:
            raise ConfigError(f"tensor_parallel_size {world_size} must divide the model's {name} ({value})")
    for name in REPLICABLE_HEADS:
        heads = getattr(cfg, name)
        if heads and heads % world_size and world_size % heads:
            raise ConfigError(f"tensor_parallel_size {world_size} and the model's {name} ({heads}) must divide one "
                              "another (heads fewer than ranks are replicated)")
    if cfg.quantization is not None:  # 16-bit tensors split wherever the heads and widths do
        check_split_shapes(cfg, world_size)


def check_split_shapes(cfg: ModelConfig, world_size: int) -> None:
    """ConfigError naming the first split layer whose checkpoint tensors do not cut into whole parts (packed words,
    quantization groups, FP8 blocks: slices.py) on `world_size` ranks, by slicing one layer of each kind (attention,
    dense MLP, experts, shared expert) for every rank as the loader will."""
    from orinfer.models.registry import model_class  # the registry imports this module

    cls = model_class(cfg.architecture)
    slicers = [checkpoint_slicer(cls.tensor_parallel_plan, cfg, TensorParallelGroup(rank, world_size))
               for rank in range(world_size)]
    for name, (fin, fout, bias) in _split_linears(cfg, cls.hf_prefix).items():
        parts = tuple(name.split("."))
        stored = stored_format(cfg.quantization, parts[-1], parts[:-1])
        for kind, shape in checkpoint_shapes(stored, fin, fout, bias).items():
            for slicer in slicers:
                slicer(f"{name}.{kind}", shape)


def _split_linears(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, int, bool]]:
    """Checkpoint name (without the tensor kind) -> (in, out, bias) of one linear of each kind the plan splits."""
    layers = range(cfg.num_hidden_layers)
    kinds = cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers
    full = next((i for i in layers if kinds[i] == "full_attention"), 0)
    h, attn = cfg.hidden_size, f"{prefix}layers.{full}.self_attn"
    q_rows = 2 * cfg.q_size if cfg.attn_output_gate else cfg.q_size  # Qwen3.5: each head's query, then its gate
    linears = {f"{attn}.q_proj": (h, q_rows, cfg.attention_bias),
               f"{attn}.k_proj": (h, cfg.kv_size, cfg.attention_bias),
               f"{attn}.v_proj": (h, cfg.kv_size, cfg.attention_bias), f"{attn}.o_proj": (cfg.q_size, h, False)}
    linear = next((i for i in layers if kinds[i] == "linear_attention"), None)
    if linear is not None:  # Qwen3.5's Gated DeltaNet: split by parts (the plan's "parts"), out_proj by rows
        la, heads = f"{prefix}layers.{linear}.linear_attn", cfg.linear_num_value_heads
        linears.update({f"{la}.in_proj_qkv": (h, cfg.linear_conv_dim, False),
                        f"{la}.in_proj_z": (h, cfg.linear_value_dim, False), f"{la}.in_proj_b": (h, heads, False),
                        f"{la}.in_proj_a": (h, heads, False), f"{la}.out_proj": (cfg.linear_value_dim, h, False)})

    def mlp(name: str, width: int) -> None:
        linears.update({f"{name}.gate_proj": (h, width, False), f"{name}.up_proj": (h, width, False),
                        f"{name}.down_proj": (width, h, False)})

    dense = next((i for i in layers if not cfg.is_sparse_layer(i)), None)
    if dense is not None:
        mlp(f"{prefix}layers.{dense}.mlp", cfg.intermediate_size)
    sparse = next((i for i in layers if cfg.is_sparse_layer(i)), None)
    if sparse is not None:
        mlp(f"{prefix}layers.{sparse}.mlp.experts.0", cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            mlp(f"{prefix}layers.{sparse}.mlp.shared_expert", cfg.shared_expert_intermediate_size)
    return linears


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's shard: heads and MLP widths divided by the world size (at least one KV head, one
    linear-attention key head)."""
    if world_size == 1:
        return cfg
    check_supported(cfg, world_size)
    divided = {name: getattr(cfg, name) // world_size for name in DIVIDED}
    kept = {name: max(1, getattr(cfg, name) // world_size) for name in REPLICABLE_HEADS if getattr(cfg, name)}
    return dataclasses.replace(cfg, **divided, **kept)


def vocab_rows(vocab_size: int, world_size: int) -> int:
    """Rows of the embedding / lm_head each rank holds (the last rank's tail is padding)."""
    return -(-vocab_size // world_size)


def rank_heads(heads: int, rank: int, world: int) -> tuple[int, int]:
    """(first head, number of heads) of `heads` that rank `rank` of `world` holds: an equal share, or with fewer
    heads than ranks the one head it shares with world / heads - 1 other ranks."""
    if heads >= world:
        return rank * (heads // world), heads // world
    return rank * heads // world, 1


def checkpoint_slicer(plan: dict[str, Any], cfg: ModelConfig, group: TensorParallelGroup) -> Slicer:
    """(checkpoint name, full shape) -> the slice rank `group.rank` reads (see the module docstring; each weight
    format's tensors: slices.py). `cfg`: the full model's config."""
    rank, world = group.rank, group.world_size
    whole, parts_of = set(plan.get("whole", ())), plan.get("parts", {})
    unquantized, fused_experts = set(plan.get("unquantized", ())), set(plan.get("fused_experts", ()))

    def split_of(module: str) -> Split | None:
        if module in plan.get("heads", ()) or module in plan.get("columns", ()):
            return Split("out", rank, world)
        if module in plan.get("kv_heads", ()):
            kv = cfg.num_key_value_heads
            # fewer KV heads than ranks: each head is replicated, ranks world/kv * h.. share head h
            return Split("out", rank, world) if kv >= world else Split("out", rank * kv // world, kv)
        if module in plan.get("rows", ()):
            return Split("in", rank, world)
        return None

    def number(value: int | str) -> int:
        return getattr(cfg, value) if isinstance(value, str) else value

    def by_parts(name: str, module: str, kind: str, shape: tuple[int, ...],
                 parts: tuple[tuple[int | str, int | str], ...], plain: bool) -> Slice:
        """The rank's heads of each part, as ranges of the tensor's output channels in its stored format."""
        axis = PLAIN if plain else output_axis(stored_format(cfg.quantization, module), kind)
        if axis is None:
            return None  # no tensor of the outputs (GPTQ's g_idx): read whole
        ranges, offset = [], 0
        for heads, width in parts:
            heads, width = number(heads), number(width)
            first, count = rank_heads(heads, rank, world)
            ranges.append((offset + first * width, count * width))
            offset += heads * width
        if -(-offset // axis.per_index) != shape[axis.dim]:
            raise WeightsError(f"{name}: {shape[axis.dim] * axis.per_index} output channels, but the config's heads "
                               f"make {offset} ({' + '.join(f'{h} x {w}' for h, w in parts)})")
        cut = parts_slice(axis, ranges, shape, f"{name} (tensor_parallel_size {world}, rank {rank})")
        return cut[0] if len(cut) == 1 else cut

    def slicer(name: str, shape: tuple[int, ...]) -> Slice:
        parts = name.split(".")
        if len(parts) < 2 or whole.intersection(parts):
            return None
        module, kind = parts[-2], parts[-1]
        packed = parts_of.get(module)
        if packed is not None:
            return by_parts(name, module, kind, shape, packed, module in unquantized)
        packed = parts_of.get(f"{module}.{kind}")
        if packed is not None:  # a block's own parameter
            return by_parts(name, module, kind, shape, packed, True)
        if module in fused_experts and kind in ("gate_up_proj", "down_proj"):
            return fused_expert_slice(name, kind, shape, cfg, rank, world)
        if module in plan.get("vocab", ()):
            rows = vocab_rows(shape[0], world)
            start = min(rank * rows, shape[0])
            return 0, start, min(rows, shape[0] - start)
        split = split_of(module)
        if split is None:
            return None
        stored = None if module in unquantized else stored_format(cfg.quantization, module, tuple(parts[:-2]))
        return tensor_slice(stored, kind, split, shape, f"{name} (tensor_parallel_size {world})")

    return slicer


def fused_expert_slice(name: str, kind: str, shape: tuple[int, ...], cfg: ModelConfig, rank: int, world: int
                       ) -> Slice:
    """Rank `rank`'s part of a fused expert tensor: of every expert, its share of the gate rows and of the up rows
    (gate_up_proj [E, 2I, H]) or of down's input columns (down_proj [E, H, I]), as per-expert tensors split. The
    transposed layout ([E, H, 2I], [E, I, H]: the published Qwen3-VL-MoE files) is told by the whole tensor's shape
    as the single-process loader tells it (layers/moe.py: per_expert_tensors), and the rank's part is handed over
    transposed back, so that the loader never has to tell its smaller part's layout (square at some world sizes)."""
    from orinfer.loader.safetensors_loader import Then  # the loader imports the registry, which imports this module

    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    rows, cols = (2 * i, h) if kind == "gate_up_proj" else (h, i)
    if len(shape) != 3 or shape[1:] not in ((rows, cols), (cols, rows)):
        raise WeightsError(f"{name}: expected shape [E, {rows}, {cols}] (or [E, {cols}, {rows}]), checkpoint has "
                           f"{list(shape)}")
    transposed = shape[1:] == (cols, rows) != (rows, cols)
    size = i // world
    if kind == "gate_up_proj":  # the gate rows of the rank, then its up rows
        dim = 2 if transposed else 1
        part: Slice = [(dim, rank * size, size), (dim, i + rank * size, size)]
    else:
        part = (1 if transposed else 2, rank * size, size)
    return Then(part, lambda t: t.transpose(1, 2)) if transposed else part


def install_reduce_hooks(model: nn.Module, plan: dict[str, Any], fold_norms: bool = False) -> None:
    """All-reduces the output of every submodule named in plan["reduce_outputs"] (a forward hook: module names, and
    so checkpoint names and the backends' decode hooks, stay as they are), except inside plan["whole"] ones.
    `fold_norms`: where the model declares that a norm adds such an output to the residual, the all-reduce is deferred
    into that norm instead (norm_fold.py; `group.lamport_enabled`)."""
    names, whole = set(plan.get("reduce_outputs", ())), set(plan.get("whole", ()))
    deferred = install_norm_folds(model, names, whole) if fold_norms else set()
    for name, module in model.named_modules():
        path = name.split(".")
        if path[-1] in names and not whole.intersection(path) and module not in deferred:
            module.register_forward_hook(_reduce_output)


def _reduce_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return all_reduce(output)
