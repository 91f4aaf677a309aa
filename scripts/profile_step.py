"""Per-kernel CUDA time of one prefill and of a prefill plus 16 batch-1 decode steps, on random Qwen3-8B weights,
under torch.profiler (eager: no CUDA graphs, so every kernel shows by name): where a step's time goes, as in the
kernel tables of docs/performance.md.

Usage (on a machine with a CUDA GPU, from the repo root):

    python3 scripts/profile_step.py [--quant awq] [--prompt-len 512] [--rows 24]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from orinfer.args import EngineArgs
from orinfer.bench.engine_bench import build_synthetic_llm
from orinfer.config import QuantConfig, preset
from orinfer.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", choices=["awq"], default=None, help="random packed AWQ weights (group size 128)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--rows", type=int, default=24, help="kernels listed per table (default 24)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = preset("qwen3-8b")
    if args.quant == "awq":
        cfg.quantization = QuantConfig(group_size=128)
    engine_args = EngineArgs(max_num_seqs=1, max_model_len=args.prompt_len + 1024, kv_cache_bytes=1 << 30,
                             cuda_graph=False, backend="triton", max_num_batched_tokens=max(2048, args.prompt_len))
    llm = build_synthetic_llm(cfg, torch.bfloat16, torch.device("cuda"), engine_args)
    ids = torch.randint(100, cfg.vocab_size - 100, (args.prompt_len,)).tolist()
    llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up, tuning
    for label, max_tokens in ((f"prefill {args.prompt_len}", 1), (f"prefill {args.prompt_len} + 16 decode steps", 17)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            torch.cuda.synchronize()
        print(f"\n### {label}\n")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
