"""One spawned process per rank for the multi-process tests (gloo on the CPU, NCCL on GPUs), with a deadline: a
rank that raises writes its traceback to out_dir/rank{r}.err (`report_failure`) and exits; `run_spawned` fails with
the first rank's traceback, or names the ranks that had not finished by the deadline (they are killed)."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Callable

import torch.multiprocessing as mp


def report_failure(out_dir: str, rank: int) -> None:
    """Called in a rank's `except BaseException:`: the traceback to out_dir/rank{rank}.err, then exit at once (no
    clean-up that could hang on a peer)."""
    Path(out_dir, f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
    os._exit(1)


def run_spawned(target: Callable[..., None], args_of: Callable[[int], tuple], world: int, out_dir: Path,
                deadline_s: float) -> None:
    """Runs target(*args_of(rank)) for ranks 0..world-1, one spawned process each, and waits up to deadline_s in all."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(rank), daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + deadline_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    errors = [(out_dir / f"rank{rank}.err").read_text() for rank in range(world)
              if (out_dir / f"rank{rank}.err").exists()]
    assert not errors, errors[0]
    assert not hung, f"ranks {hung} did not finish within {deadline_s:.0f} s"
    assert [proc.exitcode for proc in procs] == [0] * world
