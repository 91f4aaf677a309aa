"""Sparse mixture-of-experts feed-forward (Qwen3-MoE, the Qwen3.5-family MoE, Qwen3-VL-MoE).

A router (a plain [E, H] linear) scores the experts of each token; `ops.moe_route` keeps the top_k (softmax in fp32,
optionally renormalised over the k) and `ops.fused_moe` sums those experts' SwiGLU FFNs with the weights
(kernels/moe.py has the math and the packed layout). Qwen3.5's MoE adds a shared expert, an ordinary MLP that every
token runs, scaled by sigmoid(shared_expert_gate(x)) with a [1, H] gate.

Checkpoints store the routed experts one of two ways, both read here:
- per expert, `experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I] (the published releases,
  and what HF transformers' save_pretrained writes for Qwen3-MoE and Qwen3.5-MoE);
- fused over the experts, `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] (HF's save of
  Qwen3-VL-MoE), or transposed, [E, H, 2I] and [E, I, H] (the published Qwen3-VL-MoE checkpoints).
`per_expert_tensors` turns fused tensors into per-expert views, so one loader fills the packed w13 / w2 expert by
expert and never holds a second copy of them.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from orinfer.errors import WeightsError
from orinfer.layers.linear import Linear, copy_checked
from orinfer.layers.ops import Ops

# A per-expert checkpoint tensor: (experts module, expert index, projection).
_EXPERT_TENSOR = re.compile(
    r"^(?P<module>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# The packed parameter holding each projection.
_PACKED_IN = {"gate_proj": "w13", "up_proj": "w13", "down_proj": "w2"}


class ExpertWeights(nn.Module):
    """The routed experts' weights in the layout of `ops.fused_moe`: w13 [E, 2I, H] (each expert's gate rows, then
    its up rows) and w2 [E, H, I]. A parameter's shards are the checkpoint's per-expert matrices, named by their
    sub-name under `experts.` ("3.gate_proj"); each is copied into its slice as it arrives."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype), requires_grad=False)
        for param in (self.w13, self.w2):
            param.weight_loader = self._load_shard

    def shards_of(self, kind: str) -> tuple[str, ...]:
        """Every checkpoint matrix that fills parameter `kind` ("w13" or "w2")."""
        projs = [proj for proj, packed in _PACKED_IN.items() if packed == kind]
        return tuple(f"{expert}.{proj}" for expert in range(self.num_experts) for proj in projs)

    def shard_view(self, tensor: torch.Tensor, shard: str) -> torch.Tensor:
        """The slice of w13 or w2 (`tensor`) that holds checkpoint matrix `shard` ("{e}.gate_proj", ...)."""
        expert, _, proj = shard.partition(".")
        rows = self.intermediate
        part = tensor[int(expert)]
        if proj == "gate_proj":
            return part[:rows]
        return part[rows:] if proj == "up_proj" else part

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None, name: str = "") -> None:
        expert, _, proj = str(shard).partition(".")
        kind = "w13" if param is self.w13 else "w2"
        if not expert.isdigit() or int(expert) >= self.num_experts or _PACKED_IN.get(proj) != kind:
            raise WeightsError(f"{name}: no expert matrix {shard!r} among {self.num_experts} experts")
        copy_checked(self.shard_view(param.data, str(shard)), loaded, name)

    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(sub-name under `experts.`, tensor) of every per-expert matrix, as the published checkpoints name them."""
        for kind in ("w13", "w2"):
            for shard in self.shards_of(kind):
                yield f"{shard}.weight", self.shard_view(getattr(self, kind).data, shard)


class SparseMoE(nn.Module):
    """Routed experts plus an optional gated shared expert, under HF's module names (`gate`: the router, `experts`,
    `shared_expert`, `shared_expert_gate`). The shared expert is any module mapping [T, H] to [T, H] (the model's
    MLP); the router and its gate stay 16-bit dense linears whatever the model's weight format."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool, ops: Ops,
                 dtype: torch.dtype, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.ops, self.top_k, self.renormalize = ops, top_k, renormalize
        self.gate = Linear(hidden, num_experts, False, ops, dtype)
        self.experts = ExpertWeights(num_experts, hidden, intermediate, dtype)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden, 1, False, ops, dtype) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.moe_route(self.gate(x), self.top_k, self.renormalize)
        out = self.ops.fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def expert_param_for(name: str) -> tuple[str, str] | None:
    """A per-expert checkpoint name ("...mlp.experts.3.up_proj.weight") -> (our packed parameter's name, shard), or
    None for any other tensor."""
    match = _EXPERT_TENSOR.match(name)
    if match is None:
        return None
    return f"{match['module']}.{_PACKED_IN[match['proj']]}", f"{match['expert']}.{match['proj']}"


def expert_checkpoint_name(param_name: str, shard: str) -> str | None:
    """The inverse of `expert_param_for` (for messages); None when `param_name` is no packed expert parameter."""
    module, _, kind = param_name.rpartition(".")
    if not module.endswith(".experts") or kind not in ("w13", "w2"):
        return None
    return f"{module}.{shard}.weight"


def per_expert_tensors(tensors: Iterable[tuple[str, torch.Tensor]], hidden: int, intermediate: int
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every fused expert tensor (`experts.gate_up_proj`, `experts.down_proj`, either
    orientation) replaced by per-expert views under the per-expert names; other tensors pass unchanged.

    An orientation is told by the shape, as HF's loader tells it: the [E, 2I, H] / [E, H, I] layout when the tensor
    has that shape, else the transposed one (so a square case, H == 2I, reads as untransposed, as in HF)."""
    for name, tensor in tensors:
        module, _, kind = name.rpartition(".")
        if not module.endswith(".experts") or kind not in ("gate_up_proj", "down_proj"):
            yield name, tensor
            continue
        rows = 2 * intermediate if kind == "gate_up_proj" else hidden
        cols = hidden if kind == "gate_up_proj" else intermediate
        if tensor.dim() == 3 and tuple(tensor.shape[1:]) == (cols, rows) != (rows, cols):
            tensor = tensor.transpose(1, 2)
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (rows, cols):
            raise WeightsError(f"{name}: expected shape [E, {rows}, {cols}] (or [E, {cols}, {rows}]), checkpoint has "
                               f"{list(tensor.shape)}")
        for expert in range(tensor.shape[0]):
            if kind == "down_proj":
                yield f"{module}.{expert}.down_proj.weight", tensor[expert]
            else:
                yield f"{module}.{expert}.gate_proj.weight", tensor[expert, :intermediate]
                yield f"{module}.{expert}.up_proj.weight", tensor[expert, intermediate:]
