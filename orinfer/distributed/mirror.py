"""Rank 0's model calls, repeated by every worker: the call goes down each worker's pipe, then its input tensors
follow as broadcasts from rank 0 (device to device: a lookahead step's ids never visit the host).

A call's arguments are flattened: each tensor becomes a `TensorSpec` (the worker makes an empty tensor of that shape
and receives into it), dataclasses (AttentionMetadata) keep their type and fields, a hook of rank 0's runner (the state
rollback's `keep_linear_inputs`) becomes a `RankHook` that each worker replaces by its own runner's, other values
travel pickled. CUDA-graph replays are mirrored the same way: the graph's key goes down the pipes, then its input
buffers are broadcast into the workers' own buffers, and every rank replays its copy (NCCL's collectives inside
included). So are the copies of hybrid models' state slots (prefix-cache snapshots) and the speculative state rollback
(engine/state_rollback.py: work slots before a verify step, the state advanced over the accepted rows after it),
which happen outside the model's calls: each rank does them on its own shard of the state, in rank 0's order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from orinfer.distributed.group import broadcast_


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class RankHook:
    """A callable of rank 0's runner, named: each worker puts its own runner's hook of that name in its place."""

    name: str


@dataclass(frozen=True)
class _DataclassValue:
    cls: type
    fields: dict[str, Any]


Hooks = dict[str, Callable[..., Any]]


def flatten(value: Any, tensors: list[torch.Tensor], hooks: Hooks | None = None) -> Any:
    """`value` with each tensor replaced by its TensorSpec (the tensors are appended to `tensors`, in order) and each
    of `hooks` (name -> rank 0's callable) by its RankHook."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return TensorSpec(tuple(value.shape), value.dtype)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _DataclassValue(type(value), {f.name: flatten(getattr(value, f.name), tensors, hooks)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, (list, tuple)):
        return type(value)(flatten(v, tensors, hooks) for v in value)
    if isinstance(value, dict):
        return {k: flatten(v, tensors, hooks) for k, v in value.items()}
    if callable(value) and not isinstance(value, type):
        # (A bound method is made anew at each attribute access: equal, not identical, to the registered one.)
        name = next((name for name, hook in (hooks or {}).items() if hook == value), None)
        if name is None:
            raise TypeError(f"cannot mirror {value!r} to the tensor-parallel workers: not a registered hook")
        return RankHook(name)
    return value


def receive(skeleton: Any, device: torch.device, hooks: Hooks | None = None) -> Any:
    """The worker's side of `flatten` + `send_tensors`: rebuilds the value, receiving each tensor from rank 0 in
    the order they were flattened; a RankHook becomes the worker's hook of that name (`hooks`)."""
    if isinstance(skeleton, TensorSpec):
        return broadcast_(torch.empty(skeleton.shape, dtype=skeleton.dtype, device=device))
    if isinstance(skeleton, RankHook):
        return (hooks or {})[skeleton.name]
    if isinstance(skeleton, _DataclassValue):
        return skeleton.cls(**{name: receive(v, device, hooks) for name, v in skeleton.fields.items()})
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(receive(v, device, hooks) for v in skeleton)
    if isinstance(skeleton, dict):
        return {k: receive(v, device, hooks) for k, v in skeleton.items()}
    return skeleton


def runner_hooks(runner) -> Hooks:
    """The hooks of a runner that its calls' arguments may carry (rank 0's are replaced by each worker's)."""
    keep = runner._keep_linear_inputs
    return {"keep_linear_inputs": keep} if keep is not None else {}


class Mirror:
    """Sends rank 0's calls to the workers (`conns`: one pipe each). Inactive while the ranks build their runners:
    they then make the same calls each on its own, in the same order."""

    def __init__(self, conns: list, check_alive) -> None:
        self.conns, self.active = conns, False
        self.check_alive = check_alive  # raises when a worker has died (executor.py)
        self.hooks: Hooks = {}  # rank 0's runner's hooks (`runner_hooks`), set when it is attached

    def send(self, message: tuple) -> None:
        self.check_alive()
        for conn in self.conns:
            conn.send(message)

    def call(self, method: str, args: tuple, kwargs: dict, target: str = "model") -> None:
        """Has every worker call `<target>.<method>(*args, **kwargs)` on rank 0's arguments; `target`: "model", or
        "rollback" (its runner's state rollback)."""
        tensors: list[torch.Tensor] = []
        skeleton = flatten((args, kwargs), tensors, self.hooks)
        self.send(("call", target, method, skeleton))
        for tensor in tensors:
            broadcast_(tensor.contiguous())

    def replay(self, key: tuple, buffers: list[torch.Tensor]) -> None:
        """Has every worker replay its graph `key` on rank 0's graph inputs `buffers` (contiguous)."""
        self.send(("replay", key))
        for buffer in buffers:
            broadcast_(buffer)

    def copy_state(self, src: int, dst: int) -> None:
        """Has every worker copy its linear-attention state slot `src` into `dst` (a prefix-cache snapshot saved or
        restored: engine/state_pools.py), at the same point of its stream of calls."""
        if self.active:
            self.send(("state_copy", src, dst))

    def rollback(self, method: str, args: tuple) -> None:
        """Has every worker's state rollback run `method` (`StateRollback.before_call`) on rank 0's arguments."""
        if self.active:
            self.call(method, args, {}, target="rollback")

    def mirrors_now(self, device: torch.device) -> bool:
        # A capture runs on every rank at once (runner set-up): nothing to send.
        return self.active and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


class DriverModel:
    """Rank 0's shard of the model, as the runner sees it: the forward and the logits are mirrored to the workers
    before they run here; every other attribute is the shard's own."""

    def __init__(self, model: nn.Module, mirror: Mirror, device: torch.device) -> None:
        self.__dict__.update(_model=model, _mirror=mirror, _device=device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._mirror.mirrors_now(self._device):
            self._mirror.call("__call__", args, kwargs)
        return self._model(*args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._mirror.mirrors_now(self._device):
            self._mirror.call("compute_logits", (hidden,), {})
        return self._model.compute_logits(hidden)

    def mtp_forward(self, *args: Any) -> torch.Tensor:
        """The MTP head's draft step (spec_decode/mtp.py), every rank on its shard of the head."""
        if self._mirror.mirrors_now(self._device):
            self._mirror.call("mtp_forward", args, {})
        return self._model.mtp_forward(*args)
