"""A tensor-parallel worker process (ranks 1..N-1): builds its shard and runner exactly as rank 0 does, then repeats
rank 0's model calls and graph replays (mirror.py) until told to stop or rank 0 goes away."""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
from multiprocessing.connection import Client

import torch

from orinfer.distributed.group import broadcast_, destroy_group, init_group
from orinfer.distributed.mirror import receive, runner_hooks
from orinfer.distributed.shard_source import build_shard

log = logging.getLogger(__name__)


def worker_main(address: str, authkey: bytes, rank: int) -> None:
    """The process's entry point: connects to rank 0 at `address` (commands down, status up), gets the group's
    settings, builds its shard and runner, then serves rank 0's calls."""
    _die_with_parent()
    commands = Client(address, family="AF_UNIX", authkey=authkey)
    commands.send((rank, "commands"))
    status = Client(address, family="AF_UNIX", authkey=authkey)
    status.send((rank, "status"))
    world_size, init_method, source, log_level = commands.recv()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [tp{rank}] %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a stuck worker is
    from orinfer.engine.model_runner import ModelRunner
    from orinfer.spec_decode.mtp import attach_mtp_kv, mtp_kv_bytes_per_block

    try:
        group = init_group(rank, world_size, init_method, source.device(rank))
        shard = build_shard(source, group)
        # Method mtp: the shard of the MTP head gets its KV pool on the target's block ids, as on rank 0 (the draft
        # model of method draft_model lives on rank 0 alone).
        mtp_bytes = mtp_kv_bytes_per_block(shard.model, shard.config, source.args, source.act_dtype)
        runner = ModelRunner(shard.model, shard.config, source.args, shard.device, source.act_dtype,
                             source.max_model_len(), graph_hooks=shard.ops.graph_hooks,
                             extra_bytes_per_block=mtp_bytes)
        if mtp_bytes:
            attach_mtp_kv(runner, shard.model)
        status.send(("ready", rank))
        stopped = serve(commands, runner)
    except BaseException as exc:  # noqa: BLE001 - whatever stops a worker is reported to rank 0, then it exits
        log.exception("tensor-parallel worker %d failed", rank)
        try:
            status.send(("error", rank, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        os._exit(1)  # no group teardown: rank 0 aborts its side
    if stopped:
        runner.release_graphs()  # before the group: see TensorParallelExecutor.shutdown
        destroy_group()  # rank 0 leaves at the same time
    else:
        os._exit(0)  # rank 0 is gone: nobody to leave the group with


@torch.inference_mode()
def serve(commands, runner) -> bool:
    """Runs rank 0's calls in the order they come: ("call", "model" or "rollback", method, flattened arguments),
    ("replay", graph key), ("state_copy", source slot, destination slot), ("stop",). Returns True at "stop", False
    when rank 0's end of the pipe closed (rank 0 is gone)."""
    model, device, hooks = runner.model, runner.device, runner_hooks(runner)
    while True:
        try:
            message = commands.recv()
        except (EOFError, OSError):
            return False
        kind = message[0]
        if kind == "call":
            _, target, method, skeleton = message
            args, kwargs = receive(skeleton, device, hooks)
            getattr(model if target == "model" else runner.rollback, method)(*args, **kwargs)
        elif kind == "replay":
            key = message[1]
            graphs = runner.graphs if key[0] == "decode" else runner.step_graphs
            for buffer in graphs.graph_inputs(key):
                broadcast_(buffer)
            graphs.graph_for(key)[0].replay()
        elif kind == "state_copy":
            runner.state.copy(message[1], message[2])
        elif kind == "stop":
            # Rank 0's last steps (a lookahead step it will never read, too) are queued here as well: they must run
            # before this process ends, or rank 0's copies would wait on them forever.
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return True
        else:
            raise RuntimeError(f"unknown message from rank 0: {kind!r}")


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, however it dies (no orphaned worker holding a GPU)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


if __name__ == "__main__":
    worker_main(sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]))
