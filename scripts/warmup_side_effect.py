"""Run 98: a batch-1 AWQ engine built with max_num_seqs = 64 replays its batch-1 graph 0.06 ms slower than one built
with 1, even after recapturing only batch 1 (run 97). Here: one max_num_seqs = 1 engine; its batch-1 graph timed, then
again after eager decode forwards of 2, 16 and 64 rows (what capturing larger buckets runs first).
Usage (device): python3 scripts/warmup_side_effect.py"""

from __future__ import annotations

import torch

from decode_in_bench import replay_ms  # same folder
from orinfer.bench.engine_bench import _prompts, build_synthetic_llm
from orinfer.config import EngineConfig, QuantConfig, preset
from orinfer.engine.cuda_graph import DecodeGraphs
from orinfer.sampling_params import SamplingParams


def main() -> None:
    cfg = preset("qwen3-8b")
    cfg.quantization = QuantConfig(group_size=128)
    ecfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=2048, num_kv_blocks=128)
    llm = build_synthetic_llm(cfg, torch.bfloat16, torch.device("cuda"), "triton", ecfg)
    runner = llm.engine.runner
    llm.generate(_prompts(1, 128, cfg.vocab_size, 0), SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    print(f"fresh: replay {' / '.join(f'{replay_ms(llm):.3f}' for _ in range(3))} ms")
    eager = DecodeGraphs(runner.model, 64, runner.graphs.max_blocks, torch.device("cuda"))
    with torch.inference_mode():
        for rows in (2, 16, 64):
            eager._forward(rows)
            torch.cuda.synchronize()
            print(f"after an eager {rows}-row decode forward: replay "
                  f"{' / '.join(f'{replay_ms(llm):.3f}' for _ in range(3))} ms")


if __name__ == "__main__":
    main()
