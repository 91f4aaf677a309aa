"""The Lamport all-reduce (kernels/lamport_all_reduce.py) across GPUs: one spawned process per GPU in an NCCL group
with ORINFER_TP_ALLREDUCE=lamport, `group.all_reduce` against NCCL's all-reduce of the same tensors (bit for bit on 2
GPUs: one fp32 add rounded once, either way), eagerly and replayed from CUDA graphs, and the abort that releases a
call whose peer never pushes. Every run has a deadline: a hang fails the test (the ranks are killed)."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu]

DEADLINE_S = 300.0
# (shape, dtype): decode's [batch, hidden] shapes, odd ones, the smallest, and the largest the buffers take (1 MiB)
CASES = [((1, 4096), torch.bfloat16), ((3, 1000), torch.float16), ((8, 4096), torch.bfloat16),
         ((64, 4096), torch.bfloat16), ((1, 5120), torch.bfloat16), ((64, 5120), torch.bfloat16),
         ((5, 2560), torch.float32), ((1, 8), torch.bfloat16), ((128, 4096), torch.bfloat16), ((2, 4096), torch.float32)]


def needs(world: int):
    return pytest.mark.skipif(torch.cuda.device_count() < world, reason=f"needs {world} GPUs "
                              f"({torch.cuda.device_count()} here)")


def run_ranks(check: str, world: int, tmp_path: Path, monkeypatch) -> None:
    """Runs `CHECKS[check]` on ranks 0..world-1, one spawned process per GPU; fails with the first rank's traceback,
    or when the ranks have not finished by DEADLINE_S."""
    monkeypatch.setenv("ORINFER_TP_ALLREDUCE", "lamport")  # the children read it when they import orinfer
    ctx = mp.get_context("spawn")
    store = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_rank_main, args=(check, rank, world, store, str(tmp_path)), daemon=True)
             for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + DEADLINE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    errors = [(tmp_path / f"rank{rank}.err").read_text() for rank in range(world)
              if (tmp_path / f"rank{rank}.err").exists()]
    assert not errors, errors[0]
    assert not hung, f"ranks {hung} did not finish within {DEADLINE_S:.0f} s"
    assert [proc.exitcode for proc in procs] == [0] * world


def _rank_main(check: str, rank: int, world: int, store: str, out_dir: str) -> None:
    from orinfer.distributed import group

    try:
        device = torch.device("cuda", rank)
        group.init_group(rank, world, store, device, timeout_s=120.0)
        assert group.lamport_enabled(device), "ORINFER_TP_ALLREDUCE=lamport did not reach the rank"
        CHECKS[check](rank, world, device)
        torch.cuda.synchronize(device)
        group.destroy_group()
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        Path(out_dir, f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        os._exit(1)


def _partial(call: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s input of call `call` (the same on every run)."""
    gen = torch.Generator(device=device).manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def _nccl(x: torch.Tensor) -> torch.Tensor:
    want = x.clone()
    dist.all_reduce(want)
    return want


def _assert_like_nccl(got: torch.Tensor, want: torch.Tensor, world: int) -> None:
    """Bit for bit on 2 ranks (-0.0 and +0.0 compare equal: Lamport sums -0.0 as +0.0); on more, NCCL adds in another
    order. Every rank must also hold the same bits."""
    if world == 2:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want)
    bits = got.view(torch.int16 if got.element_size() == 2 else torch.int32)
    gathered = [torch.empty_like(bits) for _ in range(world)]
    dist.all_gather(gathered, bits)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def check_eager(rank: int, world: int, device: torch.device) -> None:
    """Many calls of every case in turn (each slot reused many times), against NCCL."""
    from orinfer.distributed import group

    for call in range(300):
        shape, dtype = CASES[call % len(CASES)]
        x = _partial(call, rank, shape, dtype, device)
        want = _nccl(x)
        assert group.all_reduce(x) is x
        _assert_like_nccl(x, want, world)


def check_graphs(rank: int, world: int, device: torch.device) -> None:
    """The calls captured in one CUDA graph, replayed with new inputs, eager calls in between (the slot state is
    shared, on the device: every replay moves it on)."""
    from orinfer.distributed import group

    cases = CASES[:7]
    inputs = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in cases]
    for x in inputs:  # warm-up: the buffers are made outside the capture
        group.all_reduce(x.clone())
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [group.all_reduce(x.clone()) for x in inputs]
    for replay in range(8):
        fresh = [_partial(100 * replay + i, rank, shape, dtype, device) for i, (shape, dtype) in enumerate(cases)]
        for x, value in zip(inputs, fresh):
            x.copy_(value)
        graph.replay()
        for out, value in zip(outputs, fresh):
            _assert_like_nccl(out, _nccl(value), world)
        between = _partial(5000 + replay, rank, (3, 4096), torch.bfloat16, device)
        want = _nccl(between)
        _assert_like_nccl(group.all_reduce(between), want, world)


def check_abort(rank: int, world: int, device: torch.device) -> None:
    """Rank 0 calls once more alone: the call waits (its peers never push) until the group is aborted."""
    from orinfer.distributed import group

    group.all_reduce(torch.ones(1, 4096, dtype=torch.bfloat16, device=device))  # every rank: the buffers exist
    torch.cuda.synchronize(device)
    dist.barrier()
    if rank == 0:
        x = torch.ones(1, 4096, dtype=torch.bfloat16, device=device)
        group.all_reduce(x)
        done = torch.cuda.Event()
        done.record()
        time.sleep(1.0)
        assert not done.query(), "an all-reduce finished without its peers' data"
        group.abort_collectives()
        done.synchronize()  # returns: the poll gave up (a hang here is the run's deadline)
    dist.barrier()


CHECKS = {"eager": check_eager, "graphs": check_graphs, "abort": check_abort}


@pytest.mark.parametrize("world", [pytest.param(2, marks=needs(2)), pytest.param(4, marks=needs(4))])
def test_eager_calls_match_nccl(world, tmp_path, monkeypatch):
    run_ranks("eager", world, tmp_path, monkeypatch)


@needs(2)
def test_cuda_graph_replays_match_nccl(tmp_path, monkeypatch):
    run_ranks("graphs", 2, tmp_path, monkeypatch)


@needs(2)
def test_abort_releases_a_call_whose_peer_never_pushes(tmp_path, monkeypatch):
    run_ranks("abort", 2, tmp_path, monkeypatch)
