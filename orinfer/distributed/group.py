"""This process's place in the tensor-parallel group, and the collectives the sharded layers use.

A process that never joined a group is rank 0 of 1: every collective is then the identity, so layers call them
unconditionally and single-GPU runs pay nothing. Collectives are queued on the device like any kernel (no host
wait on NCCL), so they also record into CUDA graphs.
"""

from __future__ import annotations

import datetime
import logging
import os
from contextlib import contextmanager
from typing import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from orinfer.distributed import lamport
from orinfer.distributed.lamport import LamportBuffers
from orinfer.errors import ConfigError
from orinfer.kernels.lamport_all_reduce import (LamportWorkspace, fused_fits, lamport_all_reduce_,
                                                lamport_all_reduce_add_rms_norm)
from orinfer.kernels.norm import rms_norm_ref

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


_group = TensorParallelGroup()


def current() -> TensorParallelGroup:
    """The group this process runs in (rank 0 of 1 unless `init_group` ran)."""
    return _group


@contextmanager
def rank_local() -> Iterator[None]:
    """Within it, this process builds and runs models as if alone (rank 0 of 1): no split layers, no collectives. For
    what only rank 0 holds, e.g. a speculative-decoding draft model beside a tensor-parallel target."""
    global _group
    saved, _group = _group, TensorParallelGroup()
    try:
        yield
    finally:
        _group = saved


def init_group(rank: int, world_size: int, init_method: str, device: torch.device,
               timeout_s: float = 600.0) -> TensorParallelGroup:
    """Joins the group: NCCL for CUDA devices (bound to `device`, whose communicator is made now, before any CUDA
    graph could capture its first use), gloo on the CPU. `init_method`: a file:// or tcp:// rendezvous all ranks
    share."""
    global _group
    if dist.is_initialized():
        raise ConfigError("this process already belongs to a tensor-parallel group that could not be left (see the "
                          "log); start the new engine in a new process")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
        _agree_on_symmetric_memory(device)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _group = TensorParallelGroup(rank, world_size)
    return _group


def destroy_group(abort: bool = False) -> None:
    """Leaves the group (this process is rank 0 of 1 again). Every rank leaves together after a clean stop (NCCL's
    finalize waits for its peers to finalize too); `abort` (a peer died, or rank 0 is gone) drops this rank's
    communicators without waiting for anyone."""
    global _group, _symmetric_allowed
    _group = TensorParallelGroup()
    _symmetric.clear()
    _lamport.clear()
    _symmetric_allowed = False
    if not dist.is_initialized():
        return
    if abort and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


# A decode step makes two all-reduces per layer, of [B, H] each, where NCCL's latency per call dominates
# (benchmarks/NOTES.md, run 288). On GPUs those of at most lamport.MAX_BYTES go through orinfer's barrier-free
# one-shot kernel (kernels/lamport_all_reduce.py, the default: 3.3-5.7 us against torch's symm_mem one-shot's
# 7.6-11.4 and NCCL's 10-14 at [1..64, 4096] bf16 on two H200s, run 367), and the all-reduces that feed a norm with
# the residual are folded into it (distributed/norm_fold.py: `all_reduce_add_rms_norm`). ORINFER_TP_ALLREDUCE=symm_mem
# takes torch's symmetric-memory one-shot instead (each rank stages its tensor in a buffer its peers read over NVLink,
# up to SYMMETRIC_MAX_BYTES), =nccl NCCL for all. Larger ones use NCCL. NVLink multicast is never used.
SYMMETRIC_MAX_BYTES = 1 << 20
_MODE = os.environ.get("ORINFER_TP_ALLREDUCE", "")  # read once: all_reduce runs twice per layer
_NCCL_ONLY = _MODE == "nccl"
_LAMPORT = _MODE in ("", "lamport")
if _MODE not in ("", "nccl", "lamport", "symm_mem"):
    logger.warning("ORINFER_TP_ALLREDUCE=%s is not one of lamport (the default), symm_mem, nccl: using the default",
                   _MODE)
_symmetric: dict[torch.dtype, torch.Tensor] = {}
_lamport: dict[torch.dtype, LamportBuffers] = {}
# torch's symmetric-memory rendezvous numbers its store exchanges per process, not per group: a process that took part
# in one group's rendezvous and joins a second group (a test, or a script making two engines) is out of step with the
# fresh workers of the second group, and their rendezvous never meets (the hang of run 292; cf. pytorch/pytorch#196082,
# the same sequence-number mismatch through subgroups). Such a group therefore uses NCCL for every all-reduce.
_rendezvous_done_in_process = False
_symmetric_allowed = False


def _agree_on_symmetric_memory(device: torch.device) -> None:
    """Every rank learns whether any rank's process has done a symmetric-memory rendezvous before (one tiny
    all-reduce at join), so all ranks take the same all-reduce path."""
    global _symmetric_allowed
    flag = torch.tensor([int(_rendezvous_done_in_process)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    _symmetric_allowed = not bool(flag.item()) and not _NCCL_ONLY
    if not _symmetric_allowed and not _NCCL_ONLY:
        logger.warning("tensor parallelism: this process has joined a group before, so every all-reduce goes through "
                       "NCCL (torch's symmetric memory cannot rendezvous again in the same process); decode is slower "
                       "than in a fresh process")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums `x` over the ranks, in place; returns it."""
    if not _group.enabled:
        return x
    nbytes = x.numel() * x.element_size()
    if _lamport_takes(x):
        lamport_all_reduce_(x, _lamport_buffers(x.dtype, x.device).workspace)
    elif (x.is_cuda and x.is_contiguous() and nbytes <= SYMMETRIC_MAX_BYTES and nbytes % 16 == 0
            and x.dtype in (torch.bfloat16, torch.float32) and _symmetric_allowed):
        staging = _symmetric_buffer(x.dtype, x.device)[:x.numel()]
        staging.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staging, "sum", dist.group.WORLD.group_name, x.view(-1))
    else:
        dist.all_reduce(x)
    return x


def _symmetric_buffer(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The staging buffer of `dtype`, made (a collective: every rank's first all-reduce of this dtype comes at the same
    point of the same warm-up forward, never inside a CUDA-graph capture) on first use."""
    buffer = _symmetric.get(dtype)
    if buffer is None:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(SYMMETRIC_MAX_BYTES // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                                device=device)
        global _rendezvous_done_in_process
        _rendezvous_done_in_process = True
        symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        _symmetric[dtype] = buffer
    return buffer


def lamport_enabled(device: torch.device) -> bool:
    """Whether this rank's all-reduces on `device` may take the Lamport kernels (the default: ORINFER_TP_ALLREDUCE
    unset or lamport, a GPU, a group that may use symmetric memory); the same answer on every rank."""
    return _LAMPORT and _group.enabled and device.type == "cuda" and _symmetric_allowed


def _lamport_takes(x: torch.Tensor) -> bool:
    return lamport_enabled(x.device) and lamport.fits(x)


def _lamport_buffers(dtype: torch.dtype, device: torch.device) -> LamportBuffers:
    """The Lamport receive buffers of `dtype`, made (a collective, as `_symmetric_buffer`'s) on first use."""
    buffers = _lamport.get(dtype)
    if buffers is None:
        global _rendezvous_done_in_process
        _rendezvous_done_in_process = True
        buffers = LamportBuffers(dtype, device, dist.group.WORLD.group_name, _group.rank, _group.world_size)
        _lamport[dtype] = buffers
    return buffers


def lamport_workspace(dtype: torch.dtype, device: torch.device) -> LamportWorkspace:
    """This rank's Lamport workspace of `dtype`, whatever ORINFER_TP_ALLREDUCE says (for benchmarks and tests); its
    buffers are made on first use, a collective."""
    return _lamport_buffers(dtype, device).workspace


def abort_collectives() -> None:
    """Releases this rank's Lamport all-reduces that wait for a peer (one died: the group is failing), as aborting
    NCCL's communicators releases theirs. Safe from any thread."""
    for buffers in list(_lamport.values()):
        buffers.abort()


def all_reduce_add_rms_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            rms_norm: Callable = rms_norm_ref) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) = rms_norm(all_reduce(partial), weight, eps, residual), as one Lamport kernel where it
    takes the tensors (`kernels/lamport_all_reduce.py`: the same rounding as the engine's fused add + RMSNorm), else
    the all-reduce (in place on `partial`) and then `rms_norm` (the backend's, with rms_norm_ref's signature)."""
    if _lamport_takes(partial) and fused_fits(partial, residual, weight):
        return lamport_all_reduce_add_rms_norm(partial, residual, weight, eps,
                                               _lamport_buffers(partial.dtype, partial.device).workspace)
    return rms_norm(all_reduce(partial), weight, eps, residual)


def all_gather_columns(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[R, n] per rank -> [R, world * n] in `out_dtype` (default x's): rank r's columns at [r * n, (r + 1) * n) (a
    vocab-parallel head's logits). The ranks' blocks are gathered in x's dtype; one copy puts them in column order and
    converts them."""
    out_dtype = out_dtype or x.dtype
    if not _group.enabled:
        return x.to(out_dtype)
    x = x.contiguous()
    stacked = torch.empty((_group.world_size, *x.shape), dtype=x.dtype, device=x.device)
    if x.device.type == "cuda":
        dist.all_gather_into_tensor(stacked, x)
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(stacked.unbind(0)), x)
    out = torch.empty((x.shape[0], _group.world_size, x.shape[1]), dtype=out_dtype, device=x.device)
    out.copy_(stacked.permute(1, 0, 2))
    return out.view(x.shape[0], -1)


def broadcast_(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` into every rank's `x` (contiguous, same shape and dtype everywhere), in place."""
    if _group.enabled:
        dist.broadcast(x, src=0)
    return x


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (ranks that size something alike, e.g. the KV-cache blocks)."""
    if not _group.enabled:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
