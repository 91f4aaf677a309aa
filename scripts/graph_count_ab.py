"""Why the engine built for 64 sequences replays its batch-1 decode graph slower (~0.06-0.13 ms, runs 96-102,
123-124: the kernels take the same time with PDL off, the gaps between them grow): in one engine built for 1 sequence,
time the batch-1 graph's replay while other decode graphs are alive (the 64-row buckets, or copies of the batch-1
graph) and after they are deleted (run 125: no effect). Usage (device): python3 scripts/graph_count_ab.py"""

from __future__ import annotations

import gc

import torch

from decode_in_bench import awq_engine, replays  # same folder
from orinfer.config import EngineConfig
from orinfer.engine.cuda_graph import DecodeGraphs


def extra_graphs(runner, max_batch: int, copies: int = 1) -> list[DecodeGraphs]:
    """`copies` more sets of decode graphs for up to `max_batch` rows, each in its own pool, kept alive."""
    sets = []
    for _ in range(copies):
        graphs = DecodeGraphs(runner.model, max_batch, runner.graphs.max_blocks, torch.device("cuda"),
                              runner.block_size)
        graphs.capture()
        sets.append(graphs)
    return sets


def main() -> None:
    llm = awq_engine(EngineConfig(max_num_seqs=1, max_model_len=2048, num_kv_blocks=128))
    runner = llm.engine.runner
    print(f"1-sequence engine: replay {replays(llm)} ms")
    for label, max_batch, copies in [("64-row decode graphs (8 buckets) alive", 64, 1),
                                      ("8 more batch-1 graphs alive", 1, 8),
                                      ("one more batch-1 graph alive", 1, 1),
                                      ("16-row decode graphs (5 buckets) alive", 16, 1)]:
        sets = extra_graphs(runner, max_batch, copies)
        print(f"{label}: replay {replays(llm)} ms")
        del sets
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  deleted again: replay {replays(llm)} ms")


if __name__ == "__main__":
    main()
