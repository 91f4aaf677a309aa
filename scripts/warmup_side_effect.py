"""Run 98: a batch-1 AWQ engine built with max_num_seqs = 64 replays its batch-1 graph 0.06 ms slower than one built
with 1, even after recapturing only batch 1 (run 97). Here: one max_num_seqs = 1 engine; its batch-1 graph timed, then
again after eager decode forwards of 2, 16 and 64 rows (what capturing larger buckets runs first).
Usage (device): python3 scripts/warmup_side_effect.py"""

from __future__ import annotations

import torch

from decode_in_bench import awq_engine, replays  # same folder
from orinfer.config import EngineConfig
from orinfer.engine.cuda_graph import DecodeGraphs


def main() -> None:
    llm = awq_engine(EngineConfig(max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=2048,
                                  num_kv_blocks=128))
    runner = llm.engine.runner
    print(f"fresh: replay {replays(llm)} ms")
    eager = DecodeGraphs(runner.model, 64, runner.graphs.max_blocks, torch.device("cuda"), runner.block_size)
    with torch.inference_mode():
        for rows in (2, 16, 64):
            eager._forward(rows)
            torch.cuda.synchronize()
            print(f"after an eager {rows}-row decode forward: replay {replays(llm)} ms")


if __name__ == "__main__":
    main()
