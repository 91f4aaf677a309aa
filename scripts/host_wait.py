"""Is batch-1 decode in the bench's engine bound by the host or by the device? One sequence decodes 256 tokens in an
engine built as `orinfer bench` builds it (64 sequences); per step it records the host's time blocked on the
previous step's ids (`InFlightStep.wait`), the host's time to queue a step (`ModelRunner.execute`), and on the device,
through CUDA events around each graph replay, the replay itself and the gap from one replay's end to the next one's
start (sampler, copies, and any time the stream sat empty waiting for the host).
`--skip uploads,ids,host_ids` (diagnostic: the graph then decodes from stale inputs) leaves out the graph inputs' two
host -> device copies, the lookahead's device copy of the ids and/or the copy of the sampled ids to the host (the host
then reads stale ids), to see what they cost the replay after them. `--patch PYTHON` runs a patch first (as
scripts/step_ab.py does).
Usage (device): python3 scripts/host_wait.py [SEQS] [--skip uploads,ids,host_ids] [--patch PYTHON]"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from decode_in_bench import awq_engine, decode_b1
from orinfer.config import EngineConfig
from orinfer.engine import in_flight, model_runner


class _NoCopy:
    """Stands in for a graph input buffer in `DecodeGraphs.run`: indexing and copies do nothing."""

    def __getitem__(self, key: object) -> "_NoCopy":
        return self

    def copy_(self, *args: object, **kwargs: object) -> "_NoCopy":
        return self


SKIPPABLE = {"uploads": ("dev_i64", "dev_i32"), "ids": ("input_ids",), "host_ids": ()}


def _stale_host_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """`in_flight._to_host` without the copy: a pinned tensor of the right shape, never written."""
    return t if t is None or not t.is_cuda else torch.zeros(t.shape, dtype=t.dtype, pin_memory=True)


def main() -> None:
    args = sys.argv[1:]
    skip = args.pop(args.index("--skip") + 1).split(",") if "--skip" in args else []
    args = [a for a in args if a != "--skip"]
    if "--patch" in args:
        exec(args.pop(args.index("--patch") + 1), {})  # noqa: S102  (a developer's own A/B snippet)
        args.remove("--patch")
    if "host_ids" in skip:
        in_flight._to_host = _stale_host_copy
    seqs = int(args[0]) if args else 64
    llm = awq_engine(EngineConfig(max_num_seqs=seqs, max_model_len=2064))
    graphs = llm.engine.runner.graphs
    for name in [n for s in skip for n in SKIPPABLE[s]]:
        setattr(graphs, name, _NoCopy())   # the captured graphs keep reading the real buffers
    waits, launches, events = [], [], []
    real_wait, real_execute = in_flight.InFlightStep.wait, model_runner.ModelRunner.execute
    real_replay = torch.cuda.CUDAGraph.replay

    def wait(self):
        t = time.perf_counter()
        out = real_wait(self)
        waits.append(time.perf_counter() - t)
        return out

    def execute(self, *args, **kwargs):
        t = time.perf_counter()
        out = real_execute(self, *args, **kwargs)
        launches.append(time.perf_counter() - t)
        return out

    def replay(graph):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        real_replay(graph)
        after.record()
        events.append((before, after))

    in_flight.InFlightStep.wait, model_runner.ModelRunner.execute = wait, execute
    torch.cuda.CUDAGraph.replay = replay
    steps: list[float] = []
    try:
        tok_s = decode_b1(llm, llm.engine.parts.model_config.vocab_size, steps)
    finally:
        in_flight.InFlightStep.wait, model_runner.ModelRunner.execute = real_wait, real_execute
        torch.cuda.CUDAGraph.replay = real_replay
    torch.cuda.synchronize()
    body = slice(20, -5)  # steady decode steps
    replays = [a.elapsed_time(b) for a, b in events][body]
    gaps = [events[i][1].elapsed_time(events[i + 1][0]) for i in range(len(events) - 1)][body]
    ms = [x * 1000 for x in steps[body]], [x * 1000 for x in waits[body]], [x * 1000 for x in launches[body]]
    print(f"{seqs} sequences, skipping {skip or 'nothing'}: {tok_s:.1f} tok/s; engine.step {_spread(ms[0])}")
    print(f"host blocked on the previous step's ids: {_spread(ms[1])}")
    print(f"host queuing a step (execute): {_spread(ms[2])}")
    print(f"device: graph replay {_spread(replays)}; replay end -> next replay start {_spread(gaps)}")


def _spread(values_ms: list[float]) -> str:
    """Median and 10th / 90th percentiles of per-step milliseconds."""
    ordered = sorted(values_ms)
    return (f"median {statistics.median(ordered):.3f} ms (p10 {ordered[len(ordered) // 10]:.3f}, "
            f"p90 {ordered[len(ordered) * 9 // 10]:.3f})")


if __name__ == "__main__":
    main()
