"""Sparse mixture-of-experts feed-forward (Qwen3-MoE, the Qwen3.5-family MoE, Qwen3-VL-MoE).

A router (a plain [E, H] linear) scores the experts of each token and keeps the top_k (softmax in fp32, optionally
renormalised over the k): `ops.moe_router`, the linear and `moe_route` as one op; `ops.fused_moe` sums those experts'
SwiGLU FFNs with the weights (kernels/moe.py has the math and the packed layout). Qwen3.5's MoE adds a shared expert,
an ordinary MLP that every token runs, scaled by sigmoid(shared_expert_gate(x)) with a [1, H] gate (one more row of
the router's weight, so `moe_router` computes its logit too). Two ways to run it:
- folded (the published Qwen3.5/3.6 MoE checkpoints, whose shared expert has the routed experts' width and weight
  format): the experts module has one more slot, E, holding the shared expert's matrices (loaded from
  `mlp.shared_expert.{gate_proj,up_proj,down_proj}.*`, no second copy), and the router appends the pair
  (sigmoid(logit), E) to each token's top-k: the expert ops run it beside the routed experts, k + 1 pairs a token, so
  a decode step spends no gate/up GEMV, down GEMV and combine launches of its own on it;
- separate (any other shape or format, linear_types.make_sparse_moe decides): the model's MLP module, its output
  added by `ops.shared_expert_combine`.

Checkpoints store the routed experts one of two ways, both read here:
- per expert, `experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I] (the published releases,
  and what HF transformers' save_pretrained writes for Qwen3-MoE and Qwen3.5-MoE);
- fused over the experts, `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] (HF's save of
  Qwen3-VL-MoE), or transposed, [E, H, 2I] and [E, I, H] (the published Qwen3-VL-MoE checkpoints).
`per_expert_tensors` turns fused tensors into per-expert views, so one loader fills the packed w13 / w2 expert by
expert and never holds a second copy of them.

The experts' weight format is their module's (`ExpertWeights`: 16/32-bit; layers/fp8_experts.py: FP8 block-wise, whose
per-expert `weight_scale_inv` tensors, and HF's fused `gate_up_proj_scale_inv` / `down_proj_scale_inv`, load the
same way; layers/w4_experts.py: AWQ / GPTQ-Int4, per expert `qweight`, `qzeros`, `scales`, `g_idx`; a folded shared
expert's tensors of every kind load into its slot alike); the model builds the block with
`linear_types.make_sparse_moe` and the experts module runs its own op.
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from orinfer.errors import WeightsError
from orinfer.kernels.fp8_block import FP8_DTYPE
from orinfer.layers.linear import Linear, PackedLinear, copy_checked, default_weight_loader
from orinfer.layers.ops import Ops

# A per-expert checkpoint tensor: (experts module, expert index, projection, tensor kind).
_PROJ_KIND = r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>weight|weight_scale_inv|qweight|qzeros|scales|g_idx)$"
_EXPERT_TENSOR = re.compile(r"^(?P<module>.*\.experts)\.(?P<expert>\d+)\." + _PROJ_KIND)
# A shared expert's checkpoint tensor: (MoE module, projection, tensor kind); a folded one fills the experts' slot E.
_SHARED_TENSOR = re.compile(r"^(?P<moe>.*)\.shared_expert\." + _PROJ_KIND)
# The experts' slot of a folded shared expert in shard names ("shared.up_proj"), beside the routed "0".."E-1".
SHARED_SLOT = "shared"
# A layer with a shared expert packs its router and the shared expert's gate into one linear, `gate` ([E + 1, H]: the
# router's rows, then the gate's); a model with such layers adds this to its checkpoint packing table.
ROUTER_SHARD, SHARED_GATE_SHARD = "router", "shared_gate"
SHARED_GATE_PACKING = {"gate": ("gate", ROUTER_SHARD), "shared_expert_gate": ("gate", SHARED_GATE_SHARD)}
# The packed parameter holding each projection; a tensor kind's suffix on it (FP8 scales: "w13_scale_inv").
_PACKED_IN = {"gate_proj": "w13", "up_proj": "w13", "down_proj": "w2"}
# (AWQ / GPTQ: "w13_qweight", ...; layers/w4_experts.py)
_SUFFIX = {"weight": "", "weight_scale_inv": "_scale_inv", **{k: f"_{k}" for k in ("qweight", "qzeros", "scales",
                                                                                  "g_idx")}}


class ExpertWeights(nn.Module):
    """The experts' 16/32-bit weights in the layout of `ops.fused_moe`: w13 [S, 2I, H] (each expert's gate rows, then
    its up rows) and w2 [S, H, I] over S slots: the `num_routed` routed experts, then (`shared_slot`) a folded shared
    expert in slot `num_routed`. A parameter's shards are the checkpoint's per-expert matrices, named by their
    sub-name under `experts.` ("3.gate_proj"), the shared slot's "shared.gate_proj"; each is copied into its slice as
    it arrives. Calling the module with (x [T, H], routing weights [T, k], slot ids [T, k]) gives the weighted sum of
    the chosen experts' FFNs. `num_experts` is S, the slots the expert ops index."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, ops: Ops, dtype: torch.dtype,
                 shared_slot: bool = False) -> None:
        super().__init__()
        self.ops, self.intermediate, self.num_routed = ops, intermediate, num_experts
        self.num_experts = num_experts + shared_slot
        self.shared_slot = num_experts if shared_slot else None
        self._make_weights(self.num_experts, hidden, intermediate, dtype)

    def slot_names(self) -> list[str]:
        """Each slot's name in shard names: "0".."E-1", then SHARED_SLOT for a folded shared expert."""
        return [str(e) for e in range(self.num_routed)] + ([SHARED_SLOT] if self.shared_slot is not None else [])

    def slot(self, name: str) -> int:
        """The slot index of a shard's expert part ("3", or SHARED_SLOT); ValueError for any other."""
        if name.isdigit() and int(name) < self.num_routed:
            return int(name)
        if name == SHARED_SLOT and self.shared_slot is not None:
            return self.shared_slot
        raise ValueError(f"no expert {name!r} among {self.num_routed} experts"
                         f"{' and the shared one' if self.shared_slot is not None else ''}")

    def _make_weights(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        """The parameters the checkpoint's expert matrices load into (a weight format's module makes its own)."""
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype), requires_grad=False)
        for param in (self.w13, self.w2):
            param.weight_loader = self._load_shard

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)

    def shards_of(self, kind: str) -> tuple[str, ...]:
        """Every checkpoint matrix that fills parameter `kind` ("w13" or "w2", or a tensor of theirs: "w13_...")."""
        projs = [proj for proj, packed in _PACKED_IN.items() if kind.startswith(packed)]
        return tuple(f"{expert}.{proj}" for expert in self.slot_names() for proj in projs)

    def shard_view(self, tensor: torch.Tensor, shard: str) -> torch.Tensor:
        """The slice of w13 or w2 (`tensor`, or a tensor of theirs packed the same way: FP8 scales) that holds
        checkpoint matrix `shard` ("{e}.gate_proj", "shared.up_proj", ...): gate in the first half of an expert's w13
        rows, up in the second."""
        expert, _, proj = shard.partition(".")
        part = tensor[self.slot(expert)]
        rows = part.shape[0] // 2
        if proj == "gate_proj":
            return part[:rows]
        return part[rows:] if proj == "up_proj" else part

    def _kind(self, param: nn.Parameter, shard: object, name: str) -> str:
        """The name of `param` here, after checking that checkpoint matrix `shard` belongs in it."""
        kind = next(n for n, p in self._parameters.items() if p is param)
        expert, _, proj = str(shard).partition(".")
        if expert not in self.slot_names() or not kind.startswith(_PACKED_IN.get(proj, "?")):
            raise WeightsError(f"{name}: no expert matrix {shard!r} among {self.num_routed} experts"
                               f"{' and the shared one' if self.shared_slot is not None else ''}")
        return kind

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
        self._kind(param, shard, name)
        if loaded.dtype == FP8_DTYPE:
            raise WeightsError(f"{name}: float8_e4m3fn expert weights, but config.json has no FP8 "
                               "quantization_config")
        copy_checked(self.shard_view(param.data, str(shard)), loaded, name)

    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(sub-name under `experts.`, tensor) of every per-expert matrix, as the published checkpoints name them (the
        shared slot's as "shared.{proj}.weight": `expert_tensor_name` gives its checkpoint name)."""
        for kind in ("w13", "w2"):
            for shard in self.shards_of(kind):
                yield f"{shard}.weight", self.shard_view(getattr(self, kind).data, shard)


class SparseMoE(nn.Module):
    """Routed experts plus an optional gated shared expert, under HF's module names (`gate`: the router, `experts`,
    `shared_expert`; `shared_expert_gate` is a shard of `gate`, SHARED_GATE_PACKING). The shared expert is either
    folded into the experts (`experts.shared_slot`: no `shared_expert` module) or any module mapping [T, H] to
    [T, H] (the model's MLP); the router and its gate stay 16-bit dense linears whatever the model's weight format.
    `num_experts`: the routed experts (the router's rows)."""

    def __init__(self, hidden: int, top_k: int, renormalize: bool, ops: Ops, dtype: torch.dtype,
                 experts: ExpertWeights, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        if shared_expert is not None and experts.shared_slot is not None:
            raise ValueError("a shared expert is either folded into the experts or a module of its own, not both")
        self.ops, self.top_k, self.renormalize = ops, top_k, renormalize
        self.num_experts, self.folded = experts.num_routed, experts.shared_slot is not None
        if shared_expert is None and not self.folded:
            self.gate = Linear(hidden, self.num_experts, False, ops, dtype)
        else:
            # The shared expert's [1, H] gate is one more row of the router's weight (SHARED_GATE_PACKING): one GEMV
            # instead of two per layer, as a lone [1, H] product costs a launch (two, in cuBLAS) of its own.
            self.gate = PackedLinear(hidden, {ROUTER_SHARD: self.num_experts, SHARED_GATE_SHARD: 1}, False, ops,
                                     dtype)
        self.experts = experts
        self.shared_expert = shared_expert
        self.gate.weight.weight_loader = functools.partial(_load_16_bit, loader=self.gate.weight.weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The router's linear and its top-k are one op (one launch for a decode step on the triton backend); the
        # shared gate's logit comes back from the same product, or (folded) as each token's (k+1)-th pair.
        weights, ids, shared_logit = self.ops.moe_router(x, self.gate.weight, self.top_k, self.renormalize,
                                                         self.num_experts, self.folded)
        out = self.experts(x, weights, ids)
        if self.shared_expert is None:
            return out
        return self.ops.shared_expert_combine(out, self.shared_expert(x), shared_logit)


def _load_16_bit(param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "", *,
                 loader: Callable[..., None] = default_weight_loader) -> None:
    """The router's and the shared-expert gate's loader: they run 16/32-bit whatever the model's format (Qwen's FP8
    releases list them in modules_to_not_convert), so an FP8 tensor there is an error, never a silent cast."""
    if loaded.dtype == FP8_DTYPE or not loaded.is_floating_point():
        raise WeightsError(f"{name}: the MoE router and shared-expert gate must be 16/32-bit weights (as Qwen's FP8 "
                           f"releases keep them), checkpoint has {loaded.dtype}")
    loader(param, loaded, shard, name)


def expert_param_for(name: str) -> tuple[str, str] | None:
    """A per-expert checkpoint name ("...mlp.experts.3.up_proj.weight", or its FP8 "...weight_scale_inv") -> (our
    packed parameter's name: "...mlp.experts.w13", "...w13_scale_inv"; shard "3.up_proj"), or None for any other
    tensor."""
    match = _EXPERT_TENSOR.match(name)
    if match is None:
        return None
    param = _PACKED_IN[match["proj"]] + _SUFFIX[match["kind"]]
    return f"{match['module']}.{param}", f"{match['expert']}.{match['proj']}"


def shared_slot_param_for(name: str, model: nn.Module) -> tuple[str, str] | None:
    """A shared expert's checkpoint name ("...mlp.shared_expert.up_proj.weight", FP8's "...weight_scale_inv", ...)
    in our naming -> (the experts' packed parameter, shard "shared.up_proj") when `model`'s MoE module there has
    folded it into its experts; None for any other tensor (a separate shared expert loads as the module it is)."""
    match = _SHARED_TENSOR.match(name)
    if match is None:
        return None
    try:
        moe = model.get_submodule(match["moe"])
    except AttributeError:
        return None
    if not isinstance(moe, SparseMoE) or not moe.folded:
        return None
    param = _PACKED_IN[match["proj"]] + _SUFFIX[match["kind"]]
    return f"{match['moe']}.experts.{param}", f"{SHARED_SLOT}.{match['proj']}"


def expert_tensor_name(module_name: str, sub_name: str) -> str:
    """The checkpoint name of experts module `module_name`'s tensor `sub_name` (`checkpoint_tensors`: "3.up_proj
    .weight", or a folded shared expert's "shared.up_proj.weight", which checkpoints hold under the MoE module's
    `shared_expert`)."""
    if sub_name.startswith(f"{SHARED_SLOT}."):
        return f"{module_name.removesuffix('.experts')}.shared_expert.{sub_name.partition('.')[2]}"
    return f"{module_name}.{sub_name}"


def expert_checkpoint_name(param_name: str, shard: str) -> str | None:
    """The inverse of `expert_param_for` and `shared_slot_param_for` (for messages); None when `param_name` is no
    packed expert parameter."""
    module, _, param = param_name.rpartition(".")
    kind = next((k for k, suffix in _SUFFIX.items() for packed in ("w13", "w2") if param == packed + suffix), None)
    if not module.endswith(".experts") or kind is None:
        return None
    return expert_tensor_name(module, f"{shard}.{kind}")


def expert_block_size(quantization: object) -> tuple[int, int] | None:
    """The block size whose scales fused expert tensors carry (FP8 block-wise), or None: the models pass their
    quantization config through without naming a format."""
    return getattr(quantization, "block_size", None)


def per_expert_tensors(tensors: Iterable[tuple[str, torch.Tensor]], hidden: int, intermediate: int,
                       block_size: tuple[int, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every fused expert tensor (`experts.gate_up_proj`, `experts.down_proj`, either
    orientation) replaced by per-expert views under the per-expert names; other tensors pass unchanged. With the
    FP8 `block_size` (bn, bk) their block scales too (HF's FP8 experts: `gate_up_proj_scale_inv` [E, ceil(2I/bn),
    ceil(H/bk)], `down_proj_scale_inv` [E, ceil(H/bn), ceil(I/bk)]) become per-expert `weight_scale_inv` views.

    An orientation is told by the shape, as HF's loader tells it: the [E, 2I, H] / [E, H, I] layout when the tensor
    has that shape, else the transposed one (so a square case, H == 2I, reads as untransposed, as in HF); a scale
    tensor by the same rule on its block grid (transposed scales need square blocks: W^T's blocks are then W's
    transposed)."""
    for name, tensor in tensors:
        module, _, kind = name.rpartition(".")
        proj = kind.removesuffix("_scale_inv")
        is_scale = proj != kind
        if (not module.endswith(".experts") or proj not in ("gate_up_proj", "down_proj")
                or (is_scale and block_size is None)):
            yield name, tensor
            continue
        rows = 2 * intermediate if proj == "gate_up_proj" else hidden
        cols = hidden if proj == "gate_up_proj" else intermediate
        if is_scale:
            tensor = _fused_scales(name, tensor, rows, cols, intermediate if proj == "gate_up_proj" else 0,
                                   block_size)
            split, suffix = tensor.shape[1] // 2, "weight_scale_inv"
        else:
            tensor = _oriented(name, tensor, rows, cols)
            split, suffix = intermediate, "weight"
        for expert in range(tensor.shape[0]):
            if proj == "down_proj":
                yield f"{module}.{expert}.down_proj.{suffix}", tensor[expert]
            else:
                yield f"{module}.{expert}.gate_proj.{suffix}", tensor[expert, :split]
                yield f"{module}.{expert}.up_proj.{suffix}", tensor[expert, split:]


def _oriented(name: str, tensor: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`tensor` as [E, rows, cols] (a transposed [E, cols, rows] viewed so); WeightsError for any other shape."""
    if tensor.dim() == 3 and tuple(tensor.shape[1:]) == (cols, rows) != (rows, cols):
        tensor = tensor.transpose(1, 2)
    if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (rows, cols):
        raise WeightsError(f"{name}: expected shape [E, {rows}, {cols}] (or [E, {cols}, {rows}]), checkpoint has "
                           f"{list(tensor.shape)}")
    return tensor


def _fused_scales(name: str, tensor: torch.Tensor, rows: int, cols: int, gate_rows: int,
                  block_size: tuple[int, int]) -> torch.Tensor:
    """The block scales of a fused [E, rows, cols] expert tensor as [E, ceil(rows/bn), ceil(cols/bk)]; a fused
    gate|up (gate_rows = I) must have I divisible by bn, so that no block mixes gate and up rows (orinfer keeps each
    matrix's own blocks; Qwen's real I all divide by 128)."""
    bn, bk = block_size
    grid, flipped = (-(-rows // bn), -(-cols // bk)), (-(-cols // bn), -(-rows // bk))
    if tensor.dim() == 3 and tuple(tensor.shape[1:]) == flipped != grid:
        if bn != bk:
            raise WeightsError(f"{name}: transposed expert scales need square blocks, quantization_config has "
                               f"weight_block_size {list(block_size)}")
        tensor = tensor.transpose(1, 2)
    if tensor.dim() != 3 or tuple(tensor.shape[1:]) != grid:
        raise WeightsError(f"{name}: expected block scales [E, {grid[0]}, {grid[1]}] for blocks {list(block_size)}, "
                           f"checkpoint has {list(tensor.shape)}")
    if gate_rows % bn:
        raise WeightsError(f"{name}: moe_intermediate_size {gate_rows} does not divide by the block rows {bn}, so the "
                           "fused gate_up_proj's blocks mix gate and up rows; orinfer reads such experts per expert "
                           "(experts.N.gate_proj / up_proj with their own blocks)")
    return tensor
