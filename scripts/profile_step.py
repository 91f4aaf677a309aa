"""Per-kernel CUDA time of one prefill (512 tokens) and one batch-1 decode step (eager, so kernels are visible) on
random Qwen3-8B weights; the source of the table in docs/performance.md. Usage (device): python3 scripts/profile_step.py [--quant awq]"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from orinfer.bench.engine_bench import build_synthetic_llm
from orinfer.config import EngineConfig, QuantConfig, preset
from orinfer.sampling_params import SamplingParams


def main() -> None:
    cfg = preset("qwen3-8b")
    if "--quant" in sys.argv and sys.argv[sys.argv.index("--quant") + 1] == "awq":  # random packed AWQ weights
        cfg.quantization = QuantConfig(group_size=128)
    dev = torch.device("cuda")
    llm = build_synthetic_llm(cfg, torch.bfloat16, dev, "triton",
                              EngineConfig(max_num_seqs=1, max_model_len=2048, kv_cache_bytes=1 << 30, cuda_graph=False))
    ids = torch.randint(100, 150000, (512,)).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([ids], params)  # warm-up, tuning
    for label, max_tokens in (("prefill 512", 1), ("prefill 512 + 16 decode steps", 17)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            torch.cuda.synchronize()
        print(f"\n### {label}\n")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=60))


if __name__ == "__main__":
    main()
