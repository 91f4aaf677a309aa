"""Does the order of first loads or captures decide the batch-1 graph's speed? An engine built for 64 sequences warms
up (compiles and loads) its batch-64 ... batch-2 kernels and captures their graphs before the batch-1 ones, and replays
the batch-1 graph ~0.06 ms slower than a 1-sequence engine, even with other graphs deleted or recaptured (runs 96-102,
123-125). Variants: "b1-first" runs one eager batch-1 decode forward before the engine's captures (are the kernels
loaded last the slow ones?); "graph-b1-first" captures the batch-1 graph before the others (is a graph instantiated
after several larger ones the slow one?); "ascending" captures every bucket smallest first. None changed it (runs 126,
128). One variant per process (loaded modules stay for the process's life).
Usage (device): python3 scripts/capture_order_ab.py SEQS [b1-first | graph-b1-first | ascending]"""

from __future__ import annotations

import sys

import torch

from decode_in_bench import awq_engine, replays, timed_ms  # same folder
from orinfer.config import EngineConfig
from orinfer.engine.cuda_graph import DecodeGraphs


def graph_ms(graph: torch.cuda.CUDAGraph, n: int = 100) -> float:
    return timed_ms(graph.replay, n, warm=1)


def main() -> None:
    seqs = int(sys.argv[1])
    capture = DecodeGraphs.capture
    if "b1-first" in sys.argv:

        def b1_first(self: DecodeGraphs) -> None:
            with torch.inference_mode():
                self._forward(1)
            capture(self)

        DecodeGraphs.capture = b1_first
    if "graph-b1-first" in sys.argv or "ascending" in sys.argv:
        def reordered(self: DecodeGraphs) -> None:
            buckets = self.buckets
            first = buckets if "ascending" in sys.argv else [1] + buckets[1:][::-1]
            self.buckets = first[::-1]   # capture() walks reversed(buckets)
            capture(self)
            self.buckets = buckets       # run() picks the smallest bucket >= the batch: ascending

        DecodeGraphs.capture = reordered
    llm = awq_engine(EngineConfig(max_num_seqs=seqs, max_model_len=2048, num_kv_blocks=128))
    print(f"max_num_seqs {seqs} {' '.join(sys.argv[2:])}: replay {replays(llm)} ms")
    graphs = llm.engine.runner.graphs.graphs
    for batch in (8, 64):
        if batch in graphs:
            print(f"  batch {batch} graph: replay {graph_ms(graphs[batch]):.3f} ms")


if __name__ == "__main__":
    main()
