"""Starts the tensor-parallel workers, watches them, stops them.

Rank 0 is the calling process. Each worker (ranks 1..N-1) is a fresh Python process with two connections (Unix
sockets): commands from rank 0 (mirror.py) and its status back (ready, or why it failed). A watcher thread reads the
status connections; one that closes is a worker that exited: when one dies, the others are stopped, the group's communicators are aborted (so rank 0 is not left waiting in a collective)
and every later call raises WorkerDiedError. Workers also die with rank 0's process (worker.py), so none is ever
orphaned.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener, wait
from pathlib import Path

import torch
import torch.distributed as dist

from orinfer.distributed.group import TensorParallelGroup, abort_collectives, destroy_group, init_group
from orinfer.distributed.mirror import DriverModel, Mirror, runner_hooks
from orinfer.distributed.shard_source import Shard, ShardSource, build_shard

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # how long a stopping worker may take before it is terminated
LEAVE_GROUP_S = 30.0  # how long leaving the group may take


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited: the engine cannot run another step."""


class TensorParallelExecutor:
    def __init__(self, source: ShardSource, world_size: int) -> None:
        """Starts workers 1..world_size-1, joins the group as rank 0 and builds rank 0's shard (`self.shard`)."""
        self.source, self.world_size = source, world_size
        self.failure: str | None = None
        self._stopping = False
        self._ready: set[int] = set()
        self._changed = threading.Condition()
        self._dir = tempfile.mkdtemp(prefix="orinfer-tp-")
        store = f"file://{os.path.join(self._dir, 'store')}"
        # Workers are fresh interpreters (`python -m orinfer.distributed.worker`), not multiprocessing children: those
        # would re-run the user's main script, which then needs a __main__ guard. Each connects back twice: commands
        # down, status up.
        authkey = secrets.token_bytes(16)
        listener = Listener(os.path.join(self._dir, "sock"), family="AF_UNIX", authkey=authkey)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])]))
        self._procs = [subprocess.Popen([sys.executable, "-m", "orinfer.distributed.worker", listener.address,
                                         authkey.hex(), str(rank)], env=env) for rank in range(1, world_size)]
        atexit.register(self.shutdown)
        self._commands, self._status = [None] * (world_size - 1), [None] * (world_size - 1)
        try:
            for _ in range(2 * (world_size - 1)):
                conn = listener.accept()
                rank, role = conn.recv()
                (self._commands if role == "commands" else self._status)[rank - 1] = conn
                if role == "commands":
                    conn.send((world_size, store, source, logging.getLogger().getEffectiveLevel()))
        finally:
            listener.close()
        self._watcher = threading.Thread(target=self._watch, name="orinfer-tp-watcher", daemon=True)
        self._watcher.start()
        self.mirror = Mirror(self._commands, self.check_alive)
        self.shard: Shard | None = None
        self._runner = None  # rank 0's runner, once attached
        try:
            self.group: TensorParallelGroup = init_group(0, world_size, store, source.device(0))
            log.info("tensor parallelism: %d ranks (%s)", world_size, dist.get_backend())
            self.shard = build_shard(source, self.group)
        except BaseException:
            self.shutdown()
            raise

    def driver_model(self) -> DriverModel:
        """Rank 0's shard as the runner must see it: its forward and logits mirrored to the workers."""
        return DriverModel(self.shard.model, self.mirror, self.shard.device)

    def attach(self, runner) -> None:
        """Called once rank 0's runner is built (the workers build theirs alongside, making the same collectives):
        waits for every worker to be ready, then mirrors the runner's calls, graph replays, state-slot copies and
        state rollback from here on."""
        with self._changed:
            while len(self._ready) < self.world_size - 1 and self.failure is None:
                self._changed.wait(timeout=1.0)
        self.check_alive()
        self._runner = runner
        for graphs in (runner.graphs, runner.step_graphs):
            if graphs is not None:
                graphs.before_replay = self.mirror.replay
        runner.state.before_copy = self.mirror.copy_state
        if runner.rollback is not None:
            runner.rollback.before_call = self.mirror.rollback
        self.mirror.hooks = runner_hooks(runner)
        self.mirror.active = True

    def explain(self, error: RuntimeError, wait_s: float = 5.0) -> None:
        """Raises WorkerDiedError (from `error`) if a worker died: a collective with a dead peer fails on its own,
        often before the watcher has seen the exit, so this waits up to `wait_s` for it."""
        if isinstance(error, WorkerDiedError):
            return
        deadline = time.monotonic() + wait_s
        with self._changed:
            while self.failure is None and time.monotonic() < deadline:
                self._changed.wait(timeout=0.1)
        if self.failure is not None:
            raise WorkerDiedError(self.failure) from error

    def check_alive(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def _watch(self) -> None:
        """Reads the workers' status pipes; a pipe that closes is a worker that exited. On a failure, stops the rest
        and aborts the group."""
        errors: dict[int, str] = {}
        status = {conn: rank for rank, conn in enumerate(self._status, start=1)}
        while status:
            for conn in wait(list(status)):
                rank = status[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    del status[conn]
                    if self._stopping:
                        continue
                    proc = self._procs[rank - 1]
                    try:
                        code = proc.wait(STOP_GRACE_S)
                    except subprocess.TimeoutExpired:
                        code = None
                    reason = errors.get(rank)
                    self._fail(f"tensor-parallel worker {rank} exited (code {code})" +
                               (f": {reason}" if reason else ""))
                    return
                with self._changed:
                    if message[0] == "ready":
                        self._ready.add(rank)
                    else:
                        errors[rank] = message[2]
                    self._changed.notify_all()

    def _fail(self, reason: str) -> None:
        log.error("%s; stopping the engine", reason)
        with self._changed:
            self.failure = reason
            self._changed.notify_all()
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        # A collective rank 0 waits in would never finish: aborting the communicators makes it fail instead. The
        # NCCL abort below must happen even if releasing the Lamport all-reduces fails.
        try:
            abort_collectives()
        except RuntimeError as exc:
            log.warning("could not release the Lamport all-reduces: %s", exc)
        if dist.is_initialized() and dist.get_backend() == "nccl":
            try:
                dist.distributed_c10d._get_default_group().abort()
            except (RuntimeError, AttributeError) as exc:
                log.warning("could not abort the NCCL communicators: %s", exc)

    def _leave_group(self) -> None:
        try:
            destroy_group(abort=self.failure is not None)
        except RuntimeError as exc:
            log.warning("leaving the tensor-parallel group failed: %s", exc)

    def shutdown(self) -> None:
        """Stops the workers (each finishes the call it is in) and leaves the group. Safe to call twice."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        for conn in self._commands:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        if self.failure is None and self.shard is not None and self.shard.device.type == "cuda":
            torch.cuda.synchronize(self.shard.device)  # the steps still queued, which the workers finish too
        if self._runner is not None:
            # NCCL cannot tear down a communicator while CUDA graphs that hold its kernels live (pytorch/pytorch
            # #115388: destroy_process_group then never returns; NOTES run 291 saw it): the graphs go first.
            self._runner.release_graphs()
        # Leave the group (after a failure too: a later engine in this process makes a new one). A clean stop
        # leaves with the workers, which do the same as they stop; a failed group is aborted.
        leave = threading.Thread(target=self._leave_group, name="orinfer-tp-leave", daemon=True)
        leave.start()
        leave.join(LEAVE_GROUP_S)
        if leave.is_alive():
            # A safety net: NOTES run 291 saw rank 0 never return from leaving while CUDA graphs were alive (now
            # released first, above); rather than hang the caller, the group is left behind (this process then
            # cannot start another tensor-parallel engine).
            log.warning("leaving the NCCL group did not finish in %.0f s; going on without it", LEAVE_GROUP_S)
        for proc in self._procs:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for conn in (*self._commands, *self._status):
            if conn is not None:
                conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)
