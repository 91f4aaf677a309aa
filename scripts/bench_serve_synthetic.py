#!/usr/bin/env python3
"""Serving benchmark without a checkpoint: `orinfer serve`'s app over random Qwen3-8B weights, loaded in-process.

    python3 scripts/bench_serve_synthetic.py --synthetic qwen3-8b --concurrency 1 8 64 --max-tokens 128 \
        --out benchmarks/serve-qwen3-8b.json
    python3 scripts/bench_serve_synthetic.py --no-prefix-caching --workload multi-turn --max-tokens 64 --out mt.json

Random weights emit random token ids, so the tokenizer is a synthetic word-level one covering the whole vocabulary
(token i <-> the word "w<i>"; unknown words -> w0): every id detokenizes to text, so streamed deltas, TTFT and
TPOT are measured on the real HTTP + SSE path. Prompts are random words of that vocabulary (`--word-vocab`, passed
on), so requests share no prefix unless the workload means them to. The server binds to loopback on a free port;
the engine runs in a child process, as `orinfer serve` runs it; the load generator is scripts/bench_serve.py in a
child process (as vLLM's and SGLang's serving benchmarks run: a client in the server's
process would share its interpreter lock and slow the server it measures); requests use `ignore_eos` so each produces
exactly --max-tokens tokens. Options not listed by --help (--concurrency, --max-tokens, --requests, --out, ...) go
to scripts/bench_serve.py.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import bench_serve  # same folder: the load generator and report writer
from orinfer.args import EngineArgs, add_engine_args, engine_args_from_namespace
from orinfer.bench.engine_bench import build_synthetic_llm
from orinfer.config import preset, resolve_dtype
from orinfer.server.app import ServerLimits, build_app
from orinfer.server.cli import BackgroundServer
from orinfer.server.engine_process import EngineProcess
from orinfer.tokenizer import Tokenizer


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A whitespace word-level tokenizer whose vocabulary is exactly the model's: "w0" ... "w<vocab-1>"."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    backend = BackendTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return Tokenizer(backend, {})


def synthetic_llm(name: str, dtype: torch.dtype, device: str, engine_config: EngineArgs) -> Any:
    """The benchmark's LLM: random weights of preset `name`, the synthetic tokenizer (module level: the engine
    process builds it from these picklable arguments)."""
    cfg = preset(name)
    return build_synthetic_llm(cfg, dtype, torch.device(device), engine_config,
                               tokenizer=synthetic_tokenizer(cfg.vocab_size))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--synthetic", default="qwen3-8b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--device", default="cuda")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine in a child process, as `orinfer serve` runs it (--no-engine-process: a thread)")
    add_engine_args(p, only=["enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens"])
    args, rest = p.parse_known_args(argv)
    device = torch.device(args.device)
    cfg = preset(args.synthetic)
    dtype, _ = resolve_dtype(args.dtype, device, cfg.torch_dtype)
    engine_config = engine_args_from_namespace(args).replace(max_num_seqs=args.max_num_seqs,
                                                              max_model_len=args.max_model_len)
    rest = ["--word-vocab", str(cfg.vocab_size), *rest]
    factory = functools.partial(synthetic_llm, args.synthetic, dtype, args.device, engine_config)
    if args.engine_process:
        llm = EngineProcess(factory, synthetic_tokenizer(cfg.vocab_size))
    else:
        llm = factory()
    app = build_app(llm, args.synthetic, limits=ServerLimits(max_pending_sequences=4096), reasoning=False)
    server = BackgroundServer(app).start(timeout=600)
    load_args = bench_serve.parse_args(["--url", server.url, *rest])
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "report.json"
        try:
            client = [sys.executable, str(Path(__file__).with_name("bench_serve.py")), "--url", server.url, *rest,
                      "--out", str(raw)]
            subprocess.run(client, check=False)
        finally:
            server.stop()
        if not raw.exists():
            print("the load generator wrote no report", file=sys.stderr)
            return 1
        report = json.loads(raw.read_text())
    report["command"] = "python3 scripts/bench_serve_synthetic.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report["server"] = {"model": f"synthetic {args.synthetic} ({dtype})", "max_num_seqs": args.max_num_seqs,
                        "engine_process": args.engine_process,
                        "prefix_caching": engine_config.enable_prefix_caching,
                        "chunked_prefill": engine_config.enable_chunked_prefill,
                        "max_num_batched_tokens": engine_config.max_num_batched_tokens,
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        # uvicorn's "auto" loop is uvloop when installed; the HTTP parser stays h11 (header limits)
                        "event_loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio", "http": "h11"}
    if load_args.out:  # (the child printed the table)
        bench_serve.write_report(report, Path(load_args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
