"""What a short operation queued just before the batch-1 decode graph costs: replays back to back, against replays
each preceded by the engine's input uploads (two pinned -> device copies), a device -> device copy of the ids, a
small kernel, or the greedy sampler and its device -> host copy after the graph. Usage (device):
python3 scripts/graph_launch_gap.py"""

from __future__ import annotations


import torch

from decode_in_bench import awq_engine, timed_ms
from orinfer.config import EngineConfig

ITERS = 200


def per_iteration_ms(body) -> float:
    return timed_ms(body, ITERS, warm=5)


def main() -> None:
    llm = awq_engine(EngineConfig(max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=2064,
                                  kv_cache_bytes=2 * 2064 * 2**20))
    g = llm.engine.runner.graphs
    (graph, logits), stage = g.graph_for(1, 1), g.staging[0]  # the graph of a short-context batch-1 step
    prev_ids = torch.zeros(1, dtype=torch.int64, device="cuda")
    host_ids = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    used = g.max_batch + g.max_blocks

    def upload():
        g.dev_i64.copy_(stage.i64, non_blocking=True)
        g.dev_i32[:used].copy_(stage.i32[:used], non_blocking=True)

    def sampler():
        ids = logits.float().argmax(dim=-1)
        host_ids.copy_(ids, non_blocking=True)
        prev_ids.copy_(ids)

    variants = {
        "back to back": lambda: graph.replay(),
        "dtod copy first": lambda: (g.input_ids[:1].copy_(prev_ids), graph.replay()),
        "small kernel first": lambda: (g.input_ids[:1].add_(0), graph.replay()),
        "uploads first": lambda: (upload(), graph.replay()),
        "uploads + dtod first": lambda: (upload(), g.input_ids[:1].copy_(prev_ids), graph.replay()),
        "uploads + kernel first": lambda: (upload(), g.input_ids[:1].add_(0), graph.replay()),
        "engine pattern (sampler after)": lambda: (upload(), g.input_ids[:1].copy_(prev_ids), graph.replay(),
                                                   sampler()),
    }
    for round_ in range(2):
        for name, body in variants.items():
            print(f"round {round_}: {name}: {per_iteration_ms(body):.3f} ms")


if __name__ == "__main__":
    main()
