"""Per-kernel CUDA time of one prefill and of a prefill plus 16 decode steps, on random weights of a preset's shapes,
under torch.profiler: where a step's time goes, as in the kernel tables of docs/performance.md.

Eager by default (no CUDA graphs, so every kernel shows by name and launches are not hidden); `--cuda-graph` profiles
the replayed graphs instead, whose wall time against the kernels' sum shows the host gaps between steps.

`--speculative METHOD` profiles speculative decoding instead (drafts accepted at random with `--forced-acceptance`, as
`orinfer bench --speculative` does): the decode part then holds proposals and verify steps. `--trace FILE` also writes
the decode part's Chrome trace (chrome://tracing, Perfetto): the host gaps between a step's kernels show there.

Usage (on a machine with a CUDA GPU, from the repo root):

    python3 scripts/profile_step.py [--preset qwen3-30b-a3b] [--quant awq] [--batch 8] [--prompt-len 512] [--rows 24]
    python3 scripts/profile_step.py --preset qwen3-8b --speculative draft_model --cuda-graph --trace draft.json
    python3 scripts/profile_step.py --preset qwen3-8b --tensor-parallel-size 2 --batch 64 --cuda-graph
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from orinfer.args import EngineArgs
from orinfer.bench.engine_bench import build_synthetic_llm
from orinfer.bench.run import SPEC_QUANTIZATIONS, SYNTHETIC_QUANT
from orinfer.config import preset
from orinfer.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-8b", help="the shapes (orinfer bench --synthetic names)")
    p.add_argument("--quant", choices=sorted(SYNTHETIC_QUANT), default=None, help="random weights of this format")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--cuda-graph", action="store_true", help="profile CUDA-graph replays instead of eager steps")
    p.add_argument("--rows", type=int, default=24, help="kernels listed per table (default 24)")
    p.add_argument("--speculative", choices=["ngram", "draft_model", "mtp"], default=None,
                   help="decode with speculative decoding of this method (mtp: Qwen3.5-family presets)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K")
    p.add_argument("--forced-acceptance", type=float, default=0.8, help="with --speculative (default 0.8)")
    p.add_argument("--draft-synthetic", default="qwen3-0.6b", help="--speculative draft_model: the draft's shapes")
    p.add_argument("--speculative-quantization", choices=list(SPEC_QUANTIZATIONS), default=None,
                   help="with --speculative mtp / draft_model: the drafter's linears and LM head copy in FP8")
    p.add_argument("--decode-steps", type=int, default=16, help="tokens decoded after the prompt (default 16)")
    p.add_argument("--trace", default=None, metavar="FILE", help="also write the decode part's Chrome trace here")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard over N GPUs; the tables show rank 0's kernels (the driver's process)")
    return p.parse_args(argv)


def speculative_config(args: argparse.Namespace, cfg) -> dict | None:
    """The engine's speculative_config for --speculative (None without); an MTP preset gets its one random MTP layer."""
    if args.speculative is None:
        return None
    spec = {"method": args.speculative, "num_speculative_tokens": args.num_speculative_tokens,
            "forced_acceptance": args.forced_acceptance, "max_batch": max(8, args.batch)}
    if args.speculative == "draft_model":
        spec["model"] = args.draft_synthetic
    if args.speculative_quantization:
        spec["quantization"] = args.speculative_quantization
    if args.speculative == "mtp":
        cfg.mtp_num_hidden_layers = 1
    return spec


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = preset(args.preset)
    if args.quant:
        cfg.quantization = SYNTHETIC_QUANT[args.quant]
    spec = speculative_config(args, cfg)
    # The KV budget is left to the GPU planner: the pool is capped at what max_num_seqs sequences of max_model_len can
    # use, and a hybrid preset's state pools (over 1 GiB for Qwen3.5-27B) come out of the same budget.
    engine_args = EngineArgs(max_num_seqs=max(8, args.batch), max_model_len=args.prompt_len + 1024,
                             cuda_graph=args.cuda_graph,
                             backend="triton", max_num_batched_tokens=max(2048, args.prompt_len * args.batch),
                             speculative_config=spec, tensor_parallel_size=args.tensor_parallel_size)
    draft = preset(args.draft_synthetic) if args.speculative == "draft_model" else None
    llm = build_synthetic_llm(cfg, torch.bfloat16, torch.device("cuda"), engine_args, draft=draft)
    def fresh_prompts() -> list[list[int]]:
        # Each run draws its own prompts: a prompt seen before would be served from the prefix cache, and its
        # "prefill" would profile only the tokens past the cached blocks.
        return [torch.randint(100, cfg.vocab_size - 100, (args.prompt_len,)).tolist() for _ in range(args.batch)]

    llm.generate(fresh_prompts(), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up, tuning
    steps = args.decode_steps
    for label, max_tokens in ((f"prefill {args.prompt_len}", 1), (f"prefill {args.prompt_len} + {steps} decode tokens"
                                                                   + (f" ({args.speculative})" if spec else ""),
                                                                   steps + 1)):
        prompts = fresh_prompts()
        torch.manual_seed(0)  # (forced acceptance draws from the global generator)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        verify = sum(o.metrics.num_verify_steps for o in outs)
        print(f"\n### {label} (batch {args.batch}, wall {wall * 1e3:.1f} ms under the profiler"
              + (f", {verify} verify steps" if spec else "") + ")\n")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        if args.trace and max_tokens > 1:
            prof.export_chrome_trace(args.trace)
            print(f"Chrome trace: {args.trace}")
    llm.close()  # under tensor parallelism, stops the workers before the process exits


if __name__ == "__main__":
    main()
