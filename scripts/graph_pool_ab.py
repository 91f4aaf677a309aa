"""Why max_num_seqs = 64 makes the batch-1 AWQ decode graph slower (run 96: 2.10 against 2.035 ms with 1): one
engine, its decode graphs recaptured in several ways, the batch-1 graph's replay timed after each.
Usage (device): python3 scripts/graph_pool_ab.py"""

from __future__ import annotations

import gc

import torch

from decode_in_bench import awq_engine, replays, warm_decode  # same folder
from orinfer.config import EngineConfig
from orinfer.engine.cuda_graph import DecodeGraphs


def recapture(runner, max_blocks: int, max_batch: int, order: str) -> None:
    """New decode graphs for up to `max_batch` rows. `order`: "one pool" (as the engine does: largest first, one
    shared pool), "separate pools" (each bucket its own) or "smallest first" (one pool)."""
    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    graphs = DecodeGraphs(runner.model, max_batch, max_blocks, torch.device("cuda"), runner.block_size)
    buckets = graphs.buckets
    if order == "separate pools":
        for batch in reversed(buckets):
            graphs.pool, graphs.buckets = None, [batch]
            graphs.capture()
    elif order == "smallest first":
        graphs.buckets = list(reversed(buckets))   # capture() walks reversed(buckets)
        graphs.capture()
    else:
        graphs.capture()
    graphs.buckets = buckets                       # run() picks the smallest bucket >= the batch: ascending
    runner.graphs = graphs


def main() -> None:
    llm = awq_engine(EngineConfig(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=2048,
                                  kv_cache_bytes=1 << 30))
    runner = llm.engine.runner
    max_blocks = runner.graphs.max_blocks
    print(f"as built (64, largest first, one pool): replay {replays(llm)} ms")
    for label, max_batch, order in [("recaptured the same way", 64, "one pool"),
                                    ("separate pools", 64, "separate pools"),
                                    ("smallest first, one pool", 64, "smallest first"),
                                    ("max batch 1", 1, "one pool"), ("max batch 8", 8, "one pool"),
                                    ("max batch 64 again", 64, "one pool")]:
        recapture(runner, max_blocks, max_batch, order)
        warm_decode(llm)
        print(f"{label}: replay {replays(llm)} ms")


if __name__ == "__main__":
    main()
