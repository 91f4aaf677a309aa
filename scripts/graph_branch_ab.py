"""What side-stream branches cost a CUDA graph of short PDL kernels, like the decode graphs with their L2 prefetch
forks (kernels/l2_prefetch.py). Each graph is a chain of N tiny kernels launched with PDL; variants fork a side-stream
prefetch kernel (16 KB) off the chain at some points and join it back at the end (or right after each fork). Prints
the time per replay, back to back; with `profile`, also where the profiler puts each replay's second kernel relative to
its first (the decode graphs show 8.5-10 us there under the profiler with their prefetch forks, ~1 without them).
Usage (device): python3 scripts/graph_branch_ab.py [N] [profile]"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import triton
import triton.language as tl

from decode_in_bench import timed_ms
from orinfer.kernels.l2_prefetch import PrefetchPlan
from orinfer.kernels.pdl import small_kernel_prologue


@triton.jit
def _touch_kernel(ptr, PDL: tl.constexpr):
    if PDL:
        small_kernel_prologue()
    tl.store(ptr, tl.load(ptr) + 1)


def capture(n: int, forks: list[int], join_each: bool, cell: torch.Tensor, plan: PrefetchPlan) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        forked = False
        for i in range(n):
            if i in forks:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    plan.launch()
                forked = True
                if join_each:
                    main.wait_stream(side)
            _touch_kernel[(1,)](cell, PDL=True, num_warps=1, launch_pdl=True)
        if forked and not join_each:
            main.wait_stream(side)
    return graph


def second_kernel_delays(graph: torch.cuda.CUDAGraph, n: int) -> list[float]:
    """Under torch.profiler, per replay: start of the chain's second kernel minus end of its first (us)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel" and "_touch" in e["name"]]
    events.sort(key=lambda e: e["ts"])
    return [events[i + 1]["ts"] - (events[i]["ts"] + events[i]["dur"]) for i in range(0, len(events) - 1, n)]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 330
    cell = torch.zeros(1, dtype=torch.int32, device="cuda")
    plan = PrefetchPlan([torch.zeros(4096, dtype=torch.int32, device="cuda")])
    _touch_kernel[(1,)](cell, PDL=True, num_warps=1, launch_pdl=True)
    plan.launch()
    every = [5 + k * (n // 36) for k in range(36)]
    variants = {"linear": ([], False), "one fork at the start": ([0], False), "one fork at kernel 10": ([10], False),
                "36 forks, one join at the end": (every, False), "36 forks, each joined at once": (every, True),
                "34 forks from kernel 45": ([f + 40 for f in every[:-2]], False)}
    for name, (forks, join_each) in variants.items():
        graph = capture(n, forks, join_each, cell, plan)
        times = [timed_ms(graph.replay, 200, warm=10) * 1000 for _ in range(3)]
        print(f"{name:32s} " + " / ".join(f"{t:7.1f}" for t in times) + " us per replay")
        if "profile" in sys.argv:
            print("    profiled, second kernel after the first (us): "
                  + ", ".join(f"{d:.1f}" for d in second_kernel_delays(graph, n)))


if __name__ == "__main__":
    main()
