"""The part of each checkpoint tensor a tensor-parallel rank reads, for every weight format.

A split layer's rank holds part `index` of `parts` equal parts of its channels (`Split`): of its outputs when it is
column parallel (q/k/v by heads, gate/up), of its inputs when it is row parallel (o/down). Each format stores a
linear W [N outputs, K inputs] in its own tensors, and `tensor_slice` maps one of them to the (dimension, first index,
length) the rank reads:

  format   tensor                  output split (column parallel)      input split (row parallel)
  16-bit   weight [N, K]           rows                                columns
           bias [N]                its part                            refused (every rank would add it)
  AWQ      qweight [K, N/8]        word columns (8 outputs a word)     rows, whole groups
           qzeros [K/G, N/8]       word columns                        group rows (G = -1, one group: whole)
           scales [K/G, N]         columns                             group rows (G = -1: whole)
  GPTQ     qweight [K/P, N]        columns                             word rows (P inputs a word), whole groups
           qzeros [groups, N/P]    word columns (P outputs a word)     group rows (one group: whole)
           scales [groups, N]      columns                             group rows (one group: whole)
           g_idx [K]               whole                               its part, renumbered to the rank's groups
  FP8      weight [N, K] e4m3      rows, whole 128-row blocks          columns, whole 128-column blocks
           weight_scale_inv        block rows                          block columns
           [N/bn, K/bk]

So each rank's tensors are exactly the tensors of its own (smaller) linear in the same format: the layers, their
repacking (AWQ and 4-bit GPTQ into W4) and their kernels run unchanged. A part that would cut a packed word, a group
or an FP8 block is a ConfigError naming the tensor and the sizes (`tensor_slice`), and `check_split_shapes` makes the
same checks for the whole model before anything loads.

FP8 partial blocks: Qwen's FP8 releases have one scale per 128x128 block. If a rank's rows (or columns) started or
ended inside a block, that block's scale would apply to rows of two ranks, and each rank's layer numbers its blocks
from its own first row: such a split is refused. Online FP8 (`quantization="fp8"` on a 16-bit checkpoint) has no such
limit: each rank quantizes its own slice of the 16-bit weight as it loads (layers/fp8_linear.py). When every rank's
part is whole blocks (what an FP8 checkpoint needs) the blocks are exactly those a single process makes of the same
rows and columns, so every rank holds bit for bit the single process's FP8 weights and scales for its part (tested);
the model's outputs then differ from the single process's only as any tensor-parallel run does, by the order in which
the row-parallel partial sums are added (not bit-identical; within float rounding). When parts are not whole blocks,
the blocks at a part's edge are the rank's own (fewer rows or columns than 128): a valid, slightly finer FP8
quantization than the single process's, so its weights differ there.

GPTQ act-order (desc_act): g_idx gives each input its group, in an order sorted by activation size. A column-parallel
rank reads every input, so it keeps the whole g_idx. A row-parallel rank reads a contiguous range of inputs, and
runs only if those inputs fall in its own whole groups (then the order is a permutation inside the rank's part, and
its layer repacks it as a single process does); otherwise, as with any act-order checkpoint GPTQ made without
static groups, the load fails with a ConfigError (their groups mix inputs of every rank, and per-rank scales cannot
describe them).

Packed parts (Qwen3.5's linear attention: in_proj_qkv's q | k | v by key and value heads, in_proj_z / b / a by value
heads): a column-parallel rank reads several ranges of one tensor's output channels (`parts_slice`); each range must
fall on whole units of the format (packed words, FP8 block rows) by itself, wherever it starts in the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from orinfer.errors import ConfigError
from orinfer.fp8_config import FP8Config
from orinfer.gptq_config import GPTQConfig
from orinfer.kernels.w4 import check_group_size
from orinfer.quant_config import AnyQuantConfig, QuantConfig

# (dimension, first index, length) of the part of a tensor a rank reads, optionally with a function applied to the
# part once read (GPTQ's g_idx: renumbered groups); None: the whole tensor.
Slice = tuple[int, int, int] | tuple[int, int, int, Callable[[torch.Tensor], torch.Tensor]] | None


@dataclass(frozen=True)
class Split:
    """A rank's part of a linear's channels: part `index` of `parts` equal parts of its outputs (axis "out", column
    parallel) or of its inputs (axis "in", row parallel)."""

    axis: str
    index: int
    parts: int

    def part(self, channels: int, unit: int, why: str, where: str) -> tuple[int, int]:
        """(first channel, channel count) of this part of `channels`; ConfigError unless each part is a whole number
        of `unit`s (`why` says what the unit is). One part (a replicated KV head's rank) is all of them, whatever
        they are."""
        if self.parts == 1:
            return 0, channels
        size = channels // self.parts
        if channels % self.parts or size % unit:
            per_rank = f"{channels / self.parts:g}"
            need = "not a whole number" if unit == 1 else f"not a multiple of {unit} ({why})"
            raise ConfigError(f"{where}: its {channels} {self.noun} split in {self.parts} parts give {per_rank} per "
                              f"rank, {need}")
        return self.index * size, size

    @property
    def noun(self) -> str:
        return "output channels" if self.axis == "out" else "input channels"


@dataclass(frozen=True)
class OutputAxis:
    """Where a format's tensor holds a linear's output channels: along dimension `dim`, `per_index` channels to an
    index (packed words, FP8 block rows); a part must be a whole number of `unit` channels (`why` says why)."""

    dim: int
    per_index: int = 1
    unit: int = 1
    why: str = ""


PLAIN = OutputAxis(0)  # a 16-bit tensor whose rows are the channels (a weight [N, K], a bias, a conv's channels)


# Modules whose listing in modules_to_not_convert keeps every linear inside them 16-bit (an MoE layer's shared
# expert: layers/linear_types.shared_expert_format builds it so).
_LISTED_WHOLE = ("shared_expert",)


def stored_format(quant: AnyQuantConfig | None, module: str, within: tuple[str, ...] = ()) -> AnyQuantConfig | None:
    """The format in which the checkpoint stores module `module`'s (a sub-name, "in_proj_a") tensors: None (16-bit)
    for an online-FP8 checkpoint (16-bit on disk) and for a module that modules_to_not_convert lists in any layer
    (FP8's 16-bit in_proj_a / in_proj_b, as FP8Config.dense_shards reads it), or whose enclosing modules `within`
    (the name's parts before it) include a listed shared expert; otherwise `quant`."""
    if quant is None or (isinstance(quant, FP8Config) and quant.online):
        return None
    listed = {name.rsplit(".", 1)[-1] for name in getattr(quant, "modules_to_not_convert", ())}
    inside = listed.intersection(_LISTED_WHOLE).intersection(within)
    return None if module in listed or inside else quant


def output_axis(quant: AnyQuantConfig | None, kind: str) -> OutputAxis | None:
    """How a checkpoint tensor of `kind` in `quant`'s stored format (None: 16-bit) lays out the output channels;
    None for a tensor that does not depend on them (every column-parallel rank reads it whole)."""
    if kind == "bias":
        return PLAIN
    if quant is None:
        return PLAIN if kind == "weight" else None
    if isinstance(quant, FP8Config):
        bn = quant.block_size[0]
        why = (f"FP8 scale blocks are {bn} rows: a block cut between two ranks would need one scale on both; online "
               "quantization of the 16-bit checkpoint (quantization='fp8') has no such limit")
        return {"weight": OutputAxis(0, 1, bn, why), "weight_scale_inv": OutputAxis(0, bn, bn, why)}.get(kind)
    if isinstance(quant, GPTQConfig):
        p = quant.pack_factor
        why = f"{quant.bits}-bit GPTQ packs {p} channels in each int32 word"
        return {"qweight": OutputAxis(1, 1, p, why), "scales": OutputAxis(1, 1, p, why),
                "qzeros": OutputAxis(1, p, p, why)}.get(kind)
    if isinstance(quant, QuantConfig):
        why = "AWQ packs 8 output channels in each int32 word"
        return {"qweight": OutputAxis(1, 8, 8, why), "qzeros": OutputAxis(1, 8, 8, why),
                "scales": OutputAxis(1, 1, 8, why)}.get(kind)
    raise ConfigError(f"{quant.method.upper()} weights are not supported with tensor parallelism")


def parts_slice(axis: OutputAxis, ranges: list[tuple[int, int]], shape: tuple[int, ...], where: str
                ) -> list[tuple[int, int, int]]:
    """A column-parallel rank's ranges of a tensor packed from parts: `ranges` are (first output channel, count) of
    each part's channels the rank holds, in the whole tensor's numbering; `axis` how the tensor holds them. Each
    range must be whole units by itself (the rank's tensor is its ranges concatenated): ConfigError naming the range
    otherwise."""
    out = []
    for first, count in ranges:
        if first % axis.unit or count % axis.unit:
            raise ConfigError(f"{where}: the rank's {count} output channels from channel {first} (of "
                              f"{shape[axis.dim] * axis.per_index}) are not whole multiples of {axis.unit} "
                              f"({axis.why})")
        out.append((axis.dim, first // axis.per_index, count // axis.per_index))
    return out


def tensor_slice(quant: AnyQuantConfig | None, kind: str, split: Split, shape: tuple[int, ...], where: str) -> Slice:
    """The part of a checkpoint tensor of `kind` ("weight", "qzeros", ...) and full `shape` that the rank of `split`
    reads, in the checkpoint's stored format `quant` (None: 16-bit; stored_format). `where` starts error messages
    (the tensor's name)."""
    if kind == "bias" and split.axis == "in":
        raise ConfigError(f"{where}: a row-parallel layer with a bias is not supported with tensor parallelism "
                          "(each rank would add it)")
    if split.axis == "out":
        axis = output_axis(quant, kind)
        if axis is None:
            return None  # not a tensor of the layer's outputs (or of this format): read whole
        first, size = split.part(shape[axis.dim] * axis.per_index, axis.unit, axis.why, where)
        return axis.dim, first // axis.per_index, size // axis.per_index
    if quant is None or (isinstance(quant, FP8Config) and quant.online):
        return _dense(kind, split, shape, where)
    if isinstance(quant, FP8Config):
        return _fp8(quant, kind, split, shape, where)
    if isinstance(quant, GPTQConfig):
        return _gptq(quant, kind, split, shape, where)
    if isinstance(quant, QuantConfig):
        return _awq(quant, kind, split, shape, where)
    raise ConfigError(f"{where}: {quant.method.upper()} weights are not supported with tensor parallelism")


def checkpoint_shapes(quant: AnyQuantConfig | None, in_features: int, out_features: int,
                      bias: bool = False) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors (kind -> shape) of one linear of `in_features` -> `out_features` in `quant`'s format
    (for checking a model's splits before loading it)."""
    if quant is None or (isinstance(quant, FP8Config) and quant.online):
        shapes = {"weight": (out_features, in_features)}
    elif isinstance(quant, FP8Config):
        bn, bk = quant.block_size
        shapes = {"weight": (out_features, in_features),
                  "weight_scale_inv": (-(-out_features // bn), -(-in_features // bk))}
    elif isinstance(quant, GPTQConfig):
        p, groups = quant.pack_factor, quant.num_groups(in_features)
        shapes = {"qweight": (in_features // p, out_features), "qzeros": (groups, out_features // p),
                  "scales": (groups, out_features), "g_idx": (in_features,)}
    else:
        groups = in_features // quant.group_for(in_features)
        shapes = {"qweight": (in_features, out_features // 8), "qzeros": (groups, out_features // 8),
                  "scales": (groups, out_features)}
    return shapes | ({"bias": (out_features,)} if bias else {})


# --- 16-bit ---------------------------------------------------------------------------------------------------------

# Row-parallel parts (split.axis "in") of each format; column-parallel ones are `output_axis`'s.

def _dense(kind: str, split: Split, shape: tuple[int, ...], where: str) -> Slice:
    """weight [N, K] (also a 16-bit checkpoint that online FP8 quantizes: any part, see the module docstring)."""
    if kind != "weight":
        return None  # not a tensor of this format: read whole, and the model's loader says what it is
    first, size = split.part(shape[1], 1, "", where)
    return 1, first, size


# --- AWQ ------------------------------------------------------------------------------------------------------------

def _awq(quant: QuantConfig, kind: str, split: Split, shape: tuple[int, ...], where: str) -> Slice:
    """qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]."""
    if kind not in ("qweight", "qzeros", "scales"):
        return None
    one_group = quant.group_size == -1
    if kind != "qweight":
        if one_group:
            return None  # one group over all inputs: every rank's inputs use all of it
        first, size = split.part(shape[0] * quant.group_size, quant.group_size,
                                 f"whole AWQ groups of {quant.group_size} inputs", where)
        return 0, first // quant.group_size, size // quant.group_size
    inputs = shape[0]
    group = inputs if one_group else quant.group_size
    first, size = split.part(inputs, 1 if one_group else group, f"whole AWQ groups of {group} inputs", where)
    if one_group:  # the rank's own layer, one group of its inputs, must be one the W4 layout holds
        try:
            check_group_size(size, -1)
        except ValueError as exc:
            raise ConfigError(f"{where}: AWQ with group_size -1 on {split.parts} ranks gives each rank one group of "
                              f"{size} inputs: {exc}") from None
    return 0, first, size


# --- GPTQ -----------------------------------------------------------------------------------------------------------

def _gptq(quant: GPTQConfig, kind: str, split: Split, shape: tuple[int, ...], where: str) -> Slice:
    """qweight [K/P, N], qzeros [groups, N/P], scales [groups, N], g_idx [K]."""
    if kind not in ("qweight", "qzeros", "scales", "g_idx"):
        return None
    p = quant.pack_factor
    words = f"{quant.bits}-bit GPTQ packs {p} channels in each int32 word"
    if kind in ("qzeros", "scales"):
        groups = shape[0]
        if groups == 1:
            return None  # one group over all inputs (group_size -1, or not smaller than K)
        first, size = split.part(groups, 1, "the groups must split evenly", where)
        return 0, first, size
    inputs = shape[0] * (p if kind == "qweight" else 1)
    group = quant.group_for(inputs)
    one_group = group >= inputs
    unit = p if one_group else math.lcm(group, p)
    why = words if one_group else f"whole GPTQ groups of {group} inputs, {p} inputs a word"
    first, size = split.part(inputs, unit, why, where)
    if kind == "qweight":
        return 0, first // p, size // p
    if one_group:
        return 0, first, size
    groups, first_group = size // group, first // group
    return 0, first, size, lambda g_idx: _rank_groups(g_idx, first_group, groups, first, where)


def _rank_groups(g_idx: torch.Tensor, first_group: int, groups: int, first_input: int, where: str) -> torch.Tensor:
    """A row-parallel rank's part of g_idx, renumbered to its own groups (first_group.. -> 0..); ConfigError when an
    input falls in another rank's group (act-order, module docstring)."""
    local = g_idx - first_group
    outside = (local < 0) | (local >= groups)
    if bool(outside.any()):
        k = first_input + int(outside.nonzero()[0, 0])
        raise ConfigError(
            f"{where}: GPTQ act-order (desc_act) puts input {k} in group {int(g_idx[k - first_input])}, outside this "
            f"rank's groups {first_group}..{first_group + groups - 1} (its inputs {first_input}.."
            f"{first_input + g_idx.numel() - 1}): a row-parallel layer splits only when each group's inputs lie in one "
            "rank's part. Run this checkpoint without tensor parallelism, or use one quantized with desc_act false "
            "(or static groups)")
    return local


# --- FP8 block-wise -------------------------------------------------------------------------------------------------

def _fp8(quant: FP8Config, kind: str, split: Split, shape: tuple[int, ...], where: str) -> Slice:
    """weight [N, K] e4m3, weight_scale_inv [ceil(N/bn), ceil(K/bk)]."""
    if kind not in ("weight", "weight_scale_inv"):
        return None
    if kind == "weight_scale_inv":
        first, size = split.part(shape[1], 1, "the scale blocks must split evenly", where)
        return 1, first, size
    block = quant.block_size[1]
    first, size = split.part(
        shape[1], block,
        f"FP8 scale blocks are {block} columns: a block cut between two ranks would need one scale on both; online "
        "quantization of the 16-bit checkpoint (quantization='fp8') has no such limit", where)
    return 1, first, size
