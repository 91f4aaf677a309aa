"""Why max_num_seqs = 64 makes the batch-1 AWQ decode graph slower (run 96: 2.10 against 2.035 ms with 1): one
engine, its decode graphs recaptured in several ways, the batch-1 graph's replay timed after each.
Usage (device): python3 scripts/graph_pool_ab.py"""

from __future__ import annotations

import gc

import torch

from decode_in_bench import replay_ms  # same folder
from orinfer.bench.engine_bench import _prompts, build_synthetic_llm
from orinfer.config import EngineConfig, QuantConfig, preset
from orinfer.engine.cuda_graph import DecodeGraphs
from orinfer.sampling_params import SamplingParams


def recapture(runner, max_batch: int, order: str) -> None:
    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    graphs = DecodeGraphs(runner.model, max_batch, runner.max_blocks_for_graphs, torch.device("cuda"))
    if order == "separate pools":
        for batch in reversed(graphs.buckets):
            graphs.pool = None
            graphs.buckets_backup = graphs.buckets
            graphs.buckets = [batch]
            graphs.capture()
            graphs.buckets = graphs.buckets_backup
    elif order == "smallest first":
        graphs.buckets = list(graphs.buckets)
        buckets = graphs.buckets
        graphs.buckets = list(reversed(buckets))   # capture() walks reversed(buckets): smallest first
        graphs.capture()
        graphs.buckets = buckets
    else:
        graphs.capture()
    runner.graphs = graphs


def main() -> None:
    cfg = preset("qwen3-8b")
    cfg.quantization = QuantConfig(group_size=128)
    ecfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=2048, kv_cache_bytes=1 << 30)
    llm = build_synthetic_llm(cfg, torch.bfloat16, torch.device("cuda"), "triton", ecfg)
    runner = llm.engine.runner
    runner.max_blocks_for_graphs = runner.graphs.max_blocks
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for label, max_batch, order in [("as built (64, largest first, one pool)", 64, ""),
                                    ("recaptured the same way", 64, "largest first"),
                                    ("separate pools", 64, "separate pools"),
                                    ("smallest first, one pool", 64, "smallest first"),
                                    ("max batch 1", 1, ""), ("max batch 8", 8, ""), ("max batch 64 again", 64, "")]:
        if order or max_batch != 64:
            recapture(runner, max_batch, order)
        llm.generate(_prompts(1, 128, cfg.vocab_size, 0), params)
        print(f"{label}: replay {' / '.join(f'{replay_ms(llm):.3f}' for _ in range(3))} ms")


if __name__ == "__main__":
    main()
