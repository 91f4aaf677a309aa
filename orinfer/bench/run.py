"""`orinfer bench`: ceilings, orinfer's engine, and HF transformers, measured in one run; JSON + markdown out."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import sys
from pathlib import Path

import torch

from orinfer.bench.ceilings import measure_ceilings
from orinfer.bench.engine_bench import bench_engine, build_synthetic_llm, decode_bytes_per_token, weight_bytes
from orinfer.config import EngineConfig, ModelConfig, QuantConfig, preset, resolve_dtype

log = logging.getLogger(__name__)


def add_bench_parser(sub: argparse._SubParsersAction, func) -> None:
    p = sub.add_parser("bench", help="measure prefill/decode speed against the device's ceilings")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", help="random weights of a preset's real shapes: qwen3-8b, qwen2.5-7b, qwen3-0.6b")
    src.add_argument("-m", "--model", help="a local HF model directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--prompt-lens", default="512,2048")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--quant", choices=["awq"], default=None,
                   help="random AWQ INT4 weights (group 128) of the preset's shapes instead of 16-bit ones")
    p.add_argument("--compare-hf", action="store_true", help="run the same workload through HF transformers")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--no-fused-ffn", action="store_true")
    p.add_argument("--image-size", default=None, metavar="WxH",
                   help="Qwen3-VL presets: also time the vision tower on one image of this size (and HF's tower)")
    p.add_argument("--out", default="benchmarks", help="directory for the JSON and markdown results")
    p.set_defaults(func=func)


def run_from_args(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("error: orinfer bench needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    prompt_lens = [int(x) for x in args.prompt_lens.split(",") if x]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    cfg = preset(args.synthetic) if args.synthetic else ModelConfig.from_hf(args.model)
    dtype, _ = resolve_dtype(args.dtype, device)
    name = args.synthetic or Path(args.model).name
    if args.quant:
        if not args.synthetic:
            print("error: --quant applies to --synthetic presets (a -m directory carries its own quantization)",
                  file=sys.stderr)
            return 2
        cfg.quantization = QuantConfig(group_size=128)
        name = f"{name}-{args.quant}"
    result: dict = {"model": name, "dtype": str(dtype).removeprefix("torch."), "command": "orinfer " + " ".join(
        sys.argv[sys.argv.index("bench"):] if "bench" in sys.argv else ["bench"]),
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "date": datetime.date.today().isoformat()}
    result["ceilings"] = measure_ceilings(device, dtype)
    log.info("ceilings: %s", result["ceilings"])
    if args.image_size:
        if not cfg.is_multimodal:
            print(f"error: --image-size needs a vision-language model; {name} has no vision tower", file=sys.stderr)
            return 2
        result["vision"] = _bench_vision(cfg, args, dtype, device, result["ceilings"]["matmul_TFLOPs"])

    max_len = max(prompt_lens + [128 + args.decode_tokens]) + 16
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.kv_size * dtype.itemsize * max(batch_sizes) * (128 + args.decode_tokens + 32)
    engine_config = EngineConfig(max_num_seqs=max(batch_sizes), max_num_batched_tokens=max(8192, max(prompt_lens)),
                                 max_model_len=max_len, kv_cache_bytes=max(kv_bytes, 2 * max_len * 2**20),
                                 cuda_graph=not args.no_cuda_graph, fused_ffn=not args.no_fused_ffn,
                                 backend=args.backend)
    if args.model:
        from orinfer.llm import LLM

        llm = LLM(args.model, dtype=args.dtype, device=device, backend=args.backend, max_model_len=max_len,
                  max_num_seqs=engine_config.max_num_seqs, kv_cache_bytes=engine_config.kv_cache_bytes,
                  cuda_graph=engine_config.cuda_graph, fused_ffn=engine_config.fused_ffn)
    else:
        llm = build_synthetic_llm(cfg, dtype, device, args.backend, engine_config, fused_ffn=not args.no_fused_ffn)
    model = llm.engine.parts.model
    wbytes = weight_bytes(model)
    timings = bench_engine(llm, cfg, prompt_lens, batch_sizes, args.decode_tokens)
    per_token = decode_bytes_per_token(cfg, wbytes, 128 + args.decode_tokens // 2, dtype.itemsize)
    read = result["ceilings"]["read_GBps"] * 1e9
    b1 = timings["decode"].get(1)
    result["orinfer"] = {
        **timings, "weights_GiB": wbytes / 2**30, "bytes_per_decode_token": per_token,
        "roofline_tok_s": read / per_token,
        "kv_cache_GiB": llm.engine.runner.num_blocks * llm.engine.runner.bytes_per_block() / 2**30,
        "peak_GiB": torch.cuda.max_memory_allocated(device) / 2**30,
        "backend": next(m.ops.name for m in model.modules() if hasattr(m, "ops")), "cuda_graph": llm.engine.runner.graphs is not None,
    }
    if b1:
        b1["GBps"] = b1["tok_s"] * per_token / 1e9
        b1["pct_roofline"] = 100 * b1["tok_s"] * per_token / read
    for length, row in timings["prefill"].items():
        row["mfu_pct"] = 100 * row["tflops"] / result["ceilings"]["matmul_TFLOPs"]
    del llm, model
    gc.collect()
    torch.cuda.empty_cache()
    if args.compare_hf and not args.quant:  # HF has no AWQ kernels without autoawq: its baseline is the fp16 run
        from orinfer.bench.hf_baseline import bench_hf

        torch.cuda.reset_peak_memory_stats(device)
        result["hf"] = bench_hf(cfg, dtype, device, prompt_lens, args.decode_tokens)
    write_report(result, Path(args.out))
    print(markdown(result))
    return 0


def _bench_vision(cfg: ModelConfig, args: argparse.Namespace, dtype: torch.dtype, device: torch.device,
                  matmul_tflops: float) -> dict:
    from orinfer.bench.vision_bench import bench_vision
    from orinfer.layers.ops import get_ops
    from orinfer.models.qwen3_vl_vision import VisionConfig

    width, _, height = args.image_size.lower().partition("x")
    return bench_vision(VisionConfig.from_hf(cfg.vision_config), int(width), int(height), dtype, device,
                        get_ops(args.backend, device), matmul_tflops, compare_hf=True)


def markdown(r: dict) -> str:
    c, o = r["ceilings"], r["orinfer"]
    hf = r.get("hf")
    lines = [f"## {r['model']} ({r['dtype']}) on {r['device']}, {r['date']}", "",
             f"Command: `{r['command']}`  ", f"torch {r['torch']}, backend {o['backend']}, CUDA graphs {o['cuda_graph']}",
             "", f"Ceilings (same run): read {c['read_GBps']:.0f} GB/s, copy {c['copy_GBps']:.0f} GB/s, "
             f"matmul {c['matmul_TFLOPs']:.0f} TFLOP/s. Decode roofline at batch 1: {o['roofline_tok_s']:.0f} tok/s "
             f"({o['bytes_per_decode_token'] / 1e9:.2f} GB per token).", "",
             "| metric | orinfer | HF transformers |", "| --- | --- | --- |"]
    for length, row in o["prefill"].items():
        ref = hf["prefill"].get(length, hf["prefill"].get(str(length))) if hf else None
        lines.append(f"| prefill {length} tok/s (MFU) | {row['tok_s']:.0f} ({row['mfu_pct']:.0f}%) | "
                     f"{ref['tok_s']:.0f} |" if ref else f"| prefill {length} tok/s (MFU) | {row['tok_s']:.0f} "
                     f"({row['mfu_pct']:.0f}%) | - |")
        lines.append(f"| TTFT at {length} tokens | {row['ttft_ms']:.1f} ms | - |")
    for batch, row in o["decode"].items():
        extra = f" ({row['GBps']:.0f} GB/s, {row['pct_roofline']:.0f}% of roofline)" if "pct_roofline" in row else ""
        ref = hf["decode"].get(batch, hf["decode"].get(str(batch))) if hf else None
        lines.append(f"| decode batch {batch} tok/s | {row['tok_s']:.0f}{extra} | "
                     f"{ref['tok_s']:.1f} |" if ref else f"| decode batch {batch} tok/s | {row['tok_s']:.0f}{extra} | - |")
    lines.append(f"| weights / KV cache / peak GPU memory | {o['weights_GiB']:.1f} / {o['kv_cache_GiB']:.1f} / "
                 f"{o['peak_GiB']:.1f} GiB | peak {hf['peak_gib']:.1f} GiB |" if hf else
                 f"| weights / KV cache / peak GPU memory | {o['weights_GiB']:.1f} / {o['kv_cache_GiB']:.1f} / "
                 f"{o['peak_GiB']:.1f} GiB | - |")
    if "vision" in r:
        from orinfer.bench.vision_bench import vision_markdown
        lines.extend(vision_markdown(r["vision"]))
    return "\n".join(lines) + "\n"


def write_report(result: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{result['model']}-{result['dtype']}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(result))
    return out_dir / f"{stem}.json"
