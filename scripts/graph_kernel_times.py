"""Per-kernel GPU time inside the batch-1 AWQ decode graph (torch.profiler over graph replays), for an engine built
for SEQS sequences: run it for 1 and for 64 and diff the tables to see which kernels the 64-sequence engine slows
(benchmarks/NOTES.md runs 96-102, 123; this script: run 124). With PDL a kernel's span includes its wait for the one
before it; run with ORINFER_PDL=0 too. Usage (device): python3 scripts/graph_kernel_times.py SEQS [OUT_JSON]"""

from __future__ import annotations

import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from decode_in_bench import awq_engine, replays  # same folder
from orinfer.config import EngineConfig

REPLAYS = 20


def cuda_events(graph: torch.cuda.CUDAGraph, replays: int) -> list:
    """The profiler's CUDA kernel events of `replays` back-to-back replays of `graph`, in start order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def main() -> None:
    seqs = int(sys.argv[1])
    llm = awq_engine(EngineConfig(max_num_seqs=seqs, max_model_len=2048, num_kv_blocks=128))
    print(f"max_num_seqs {seqs}: replay {replays(llm)} ms")
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in cuda_events(llm.engine.runner.graphs.graph_for(1, 1)[0], REPLAYS):
        per_name[e.name].append(e.device_time)
    rows = sorted(((sum(t) / REPLAYS, len(t) / REPLAYS, sum(t) / len(t), n) for n, t in per_name.items()),
                  reverse=True)
    print(f"| us per replay | launches per replay | us each | kernel |\n| --- | --- | --- | --- |")
    for total, count, each, name in rows[:30]:
        print(f"| {total:.1f} | {count:g} | {each:.2f} | {name[:90]} |")
    print(f"sum of kernel spans per replay: {sum(r[0] for r in rows):.1f} us")
    if len(sys.argv) > 2:
        json.dump({n: [c, e] for _, c, e, n in rows}, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
