"""Tensor-parallel all-reduce micro-benchmark at decode's shapes, on 2 GPUs (or --world N), in processes it starts:

  all-reduce                    NCCL; torch's symmetric-memory one-shot (ORINFER_TP_ALLREDUCE=symm_mem: a copy into
                                the staging buffer, then one_shot_all_reduce_out); orinfer's Lamport kernel
                                (kernels/lamport_all_reduce.py, the default)
  all-reduce + add + RMSNorm    NCCL and the one-shot, each followed by kernels/norm.py's fused add + RMSNorm (what
                                ORINFER_TP_ALLREDUCE=symm_mem runs), and the Lamport kernel that does all three
                                (what the norms fold into by default)

Shapes: [batch, hidden] bf16 rows, by default [1, 4096], [8, 4096], [64, 4096] (Qwen3-8B at batch 1, 8, 64) and
[1, 5120] (Qwen3.5-27B). Timing: on every rank, --calls calls of one op (each on its own tensors) captured back to back
in one CUDA graph, replayed --iters times after a barrier (bench/fp8_kernels.py's `replay_us`); rank 0's median replay
over the calls is the time a call (the ranks replay in step: a call waits for its peers' data). The column "vs
one-shot" is the symmetric-memory one-shot's time (with the norm, for the fused rows) over the row's. Before timing,
each op's result is checked against NCCL's (+ the norm) once: "check" says whether it matched (bit for bit at 2
ranks).

Run: `python3 -m orinfer.bench.all_reduce [--world 2] [--shapes 1x4096,8x4096,64x4096,1x5120] [--calls 32]
[--iters 50] [--json FILE] [--out DIR]` (needs --world GPUs; importing this module does not); --out writes
DIR/all-reduce.md and DIR/all-reduce.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Callable

import torch

from orinfer.bench.kernels import report

DEFAULT_SHAPES = "1x4096,8x4096,64x4096,1x5120"
EPS = 1e-6
PLAIN = ("NCCL", "symm_mem one-shot", "lamport")
FUSED = ("NCCL + norm", "symm_mem one-shot + norm", "lamport fused")


def _ops(shape: tuple[int, int], device: torch.device, calls: int, rank: int):
    """(inputs, ops): this rank's bf16 partials for `calls` calls, and name -> the op on one partial (the
    all-reduces sum it in place and return it; the norm rows return (normed, new residual), the residual and weight
    the same on every rank)."""
    import torch.distributed as dist

    from orinfer.distributed import group
    from orinfer.kernels.lamport_all_reduce import lamport_all_reduce_, lamport_all_reduce_add_rms_norm
    from orinfer.kernels.norm import rms_norm

    gen = torch.Generator(device=device).manual_seed(rank)
    shared = torch.Generator(device=device).manual_seed(1234)
    xs = [torch.randn(shape, generator=gen, device=device).bfloat16() for _ in range(calls)]
    residual = torch.randn(shape, generator=shared, device=device).bfloat16()
    weight = (torch.randn(shape[1], generator=shared, device=device) * 0.1 + 1).bfloat16()
    ws = group.lamport_workspace(torch.bfloat16, device)

    def nccl(x):
        dist.all_reduce(x)
        return x

    ops: dict[str, Callable[[torch.Tensor], object]] = {
        "NCCL": nccl, "symm_mem one-shot": group.all_reduce, "lamport": lambda x: lamport_all_reduce_(x, ws)}
    for name, reduce in zip(FUSED[:2], (nccl, group.all_reduce)):
        ops[name] = lambda x, reduce=reduce: rms_norm(reduce(x), weight, EPS, residual)
    ops["lamport fused"] = lambda x: lamport_all_reduce_add_rms_norm(x, residual, weight, EPS, ws)
    return xs, ops


def _graph_us(fn: Callable[[torch.Tensor], object], xs: list[torch.Tensor], iters: int) -> float:
    """Median microseconds a call of `fn` over the tensors `xs` (bench/fp8_kernels.py's `replay_us`: run eagerly,
    captured in one graph, replayed), the ranks starting together (every rank does the same)."""
    import torch.distributed as dist

    from orinfer.bench.fp8_kernels import replay_us

    torch.cuda.synchronize()
    dist.barrier()
    us = replay_us([lambda x=x: fn(x) for x in xs], iters)
    torch.cuda.synchronize()
    dist.barrier()
    return us


def _checks(shape: tuple[int, int], device: torch.device, rank: int) -> dict[str, bool]:
    """Each op's output on fresh inputs against NCCL's (+ the norm's): at 2 ranks, sums and residuals bit for bit
    (-0.0 == +0.0) and normed rows within one bf16 ulp (the sum of squares may add in another order); at more ranks,
    within bf16's rounding (NCCL adds in another order). Every rank runs every op (they are collectives)."""
    import torch.distributed as dist

    exact = dist.get_world_size() == 2
    xs, ops = _ops(shape, device, 1, rank)
    results = {name: op(xs[0].clone()) for name, op in ops.items()}
    ulp = torch.finfo(torch.bfloat16).eps

    def same(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
        return torch.equal(a, b) if exact and tol == 0 else torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)

    ok = {}
    for name in PLAIN:
        ok[name] = same(results[name], results["NCCL"], 0 if exact else 2 * ulp)
    for name in FUSED:
        (normed, residual), (want_normed, want_residual) = results[name], results["NCCL + norm"]
        ok[name] = same(residual, want_residual, 0 if exact else 2 * ulp) and same(normed, want_normed, 2 * ulp)
    return ok


def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist

    from orinfer.distributed import group

    device = torch.device("cuda", rank)
    group.init_group(rank, world, store, device)
    rows = []
    for shape in args.shapes:
        checks = _checks(shape, device, rank)
        xs, ops = _ops(shape, device, args.calls, rank)
        times = {name: _graph_us(fn, xs, args.iters) for name, fn in ops.items()}
        for names in (PLAIN, FUSED):
            base = times[names[1]]
            for name in names:
                rows.append({"op": "all-reduce" if names is PLAIN else "all-reduce + add + RMSNorm",
                             "shape": f"[{shape[0]}, {shape[1]}] bf16", "impl": name, "us": times[name],
                             "vs_one_shot": base / times[name], "check": checks[name]})
    torch.cuda.synchronize(device)
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    group.destroy_group()


def markdown(rows: list[dict]) -> str:
    lines = ["| op | shape | impl | us | vs one-shot | check |", "| --- | --- | --- | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {r['us']:.2f} | {r['vs_one_shot']:.2f}x | "
                     f"{'ok' if r['check'] else 'MISMATCH'} |")
    return "\n".join(lines)


def run_all_reduce_bench(args: argparse.Namespace) -> list[dict]:
    """Starts --world processes (one per GPU), runs the benchmark in them, returns rank 0's rows."""
    import torch.multiprocessing as mp

    # The children measure torch's one-shot through group.all_reduce: the default path, whatever the caller set.
    os.environ["ORINFER_TP_ALLREDUCE"] = "symm_mem"
    with tempfile.TemporaryDirectory(prefix="orinfer-allreduce-") as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(_rank_main, args=(args.world, f"file://{os.path.join(tmp, 'store')}", args, out_path),
                 nprocs=args.world, join=True)
        with open(out_path) as f:
            return json.load(f)


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="GPUs (processes) to reduce over")
    p.add_argument("--shapes", type=_shapes, default=_shapes(DEFAULT_SHAPES),
                   help=f"comma-separated TxH bf16 shapes (default {DEFAULT_SHAPES})")
    p.add_argument("--calls", type=int, default=32, help="calls captured in one graph")
    p.add_argument("--iters", type=int, default=50, help="graph replays timed (the median is reported)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--out", help="write DIR/all-reduce.md and DIR/all-reduce.json")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        print(f"the all-reduce benchmark needs {args.world} CUDA devices ({torch.cuda.device_count()} here)")
        return 1
    rows = run_all_reduce_bench(args)
    json_path = args.json or (os.path.join(args.out, "all-reduce.json") if args.out else None)
    md_path = os.path.join(args.out, "all-reduce.md") if args.out else None
    report(rows, markdown(rows), f"All-reduce micro-benchmark on {args.world} x {{device}} (bf16, {args.calls} calls "
           f"a CUDA graph, median of {args.iters} replays)", "cuda:0", json_path, md_path, world=args.world)
    return 0 if all(r["check"] for r in rows) else 2


if __name__ == "__main__":
    raise SystemExit(main())
