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
from orinfer.bench.engine_bench import (DECODE_PROMPT_LEN, bench_engine, build_synthetic_llm, kv_plan,
                                        pre_dequant_bytes, weight_bytes)
from orinfer.bench.roofline import decode_bytes_per_step, routed_expert_bytes
from orinfer.args import EngineArgs, add_engine_args, engine_args_from_namespace
from orinfer.config import ModelConfig, QuantConfig, preset, resolve_dtype
from orinfer.fp8_config import SYNTHETIC_FP8
from orinfer.gptq_config import GPTQConfig
from orinfer.server.interpreter import freeze_startup_heap
from orinfer.spec_decode.config import QUANTIZATIONS as SPEC_QUANTIZATIONS

log = logging.getLogger(__name__)


def add_bench_parser(sub: argparse._SubParsersAction, func) -> None:
    p = sub.add_parser("bench", help="measure prefill/decode speed against the device's ceilings")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", help="random weights of a preset's real shapes: qwen3-8b, qwen2.5-7b, qwen3-0.6b, "
                                          "qwen3.5-27b, qwen3-30b-a3b (MoE), qwen3.5-35b-a3b (MoE), ...")
    src.add_argument("-m", "--model", help="a local HF model directory")
    p.add_argument("--prompt-lens", default="512,2048")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-prompt-len", type=int, default=DECODE_PROMPT_LEN, metavar="N",
                   help=f"prompt tokens of each decode sequence (default {DECODE_PROMPT_LEN}): the context decode "
                        "runs at, e.g. 32768 for long-context decode; results go to a file named with -ctxN")
    p.add_argument("--quant", choices=sorted(SYNTHETIC_QUANT), default=None,
                   help="random quantized weights of the preset's shapes instead of 16-bit ones: awq (INT4, group "
                        "128), fp8 (block-wise, 128x128), gptq4 / gptq8 (symmetric, group 128); MoE presets' "
                        "experts too (fp8, awq, gptq4)")
    p.add_argument("--compare-hf", action="store_true", help="run the same workload through HF transformers")
    p.add_argument("--kv-tokens", type=int, default=None, metavar="N",
                   help="size the KV cache to exactly N tokens (rounded up to whole 16-token blocks) instead of the "
                        "default budget, e.g. 4096 to see peak memory with a 4096-token cache. Every measurement "
                        "runs with that cache: decode batch sizes are capped to the sequences of "
                        f"{DECODE_PROMPT_LEN} + --decode-tokens tokens it holds (no preemption), prompt lengths "
                        "longer than it are left out; the report says what was capped")
    p.add_argument("--image-size", default=None, metavar="WxH",
                   help="Qwen3-VL presets: also time the vision tower on one image of this size (and HF's tower)")
    p.add_argument("--speculative", choices=["ngram", "draft_model", "mtp"], default=None,
                   help="also measure decode with speculative decoding of this method at forced acceptance rates "
                        "(random weights: accepted drafts are chosen at random) against plain decoding, batch sizes "
                        "of --spec-batch-sizes (mtp: Qwen3.5-family models; synthetic presets get a random MTP "
                        "head)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K")
    p.add_argument("--draft-synthetic", default="qwen3-0.6b", metavar="PRESET",
                   help="--speculative draft_model: random weights of this preset's shapes draft (default qwen3-0.6b)")
    p.add_argument("--spec-batch-sizes", default="1,8")
    p.add_argument("--speculative-quantization", choices=list(SPEC_QUANTIZATIONS), default=None,
                   help="--speculative mtp / draft_model: the drafter's weights in this format (speculative_config "
                        "quantization: fp8 = the MTP head or the draft model and a copy of the LM head in block-wise "
                        "FP8); results go to a file named with -fp8draft")
    p.add_argument("--structured", default=None, metavar="TOKENIZER_DIR",
                   help="also measure JSON-schema-constrained decoding against unconstrained (temperature 1) at "
                        "--structured-batch-sizes; the masks need the model family's real tokenizer: a directory "
                        "with its tokenizer.json (bench/structured_bench.py)")
    p.add_argument("--structured-batch-sizes", default="1,64")
    p.add_argument("--moe-skew", action="store_true",
                   help="MoE presets: route every token to the same top-k experts (the routers' expert rows zeroed: "
                        "all logits tie, and ties go to the lowest ids) instead of the random weights' spread; "
                        "results go to a file named with -skew")
    p.add_argument("--out", default="benchmarks", help="directory for the JSON and markdown results")
    # The engine settings a benchmark may vary; the workload sets the batching limits and the KV-cache size.
    add_engine_args(p, only=BENCH_ENGINE_SETTINGS, defaults={"dtype": "bfloat16"})
    p.set_defaults(func=func)


def route_every_token_to_the_first_experts(model: torch.nn.Module) -> int:
    """Zeroes the routed experts' rows of every MoE router (a shared-expert gate row packed below them stays, and a
    folded shared expert keeps its slot and gate): each token's expert logits then tie, and ties go to the lowest ids
    (the routing kernels' contract), so every token picks experts 0..k-1 with equal weights: the skewed load of
    `--moe-skew`. Returns the MoE layers changed."""
    from orinfer.layers.moe import SparseMoE

    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    with torch.no_grad():
        for moe in layers:
            moe.gate.weight[:moe.num_experts].zero_()
    return len(layers)


# --quant: the weight format of the random weights.
SYNTHETIC_QUANT = {"awq": QuantConfig(group_size=128), "fp8": SYNTHETIC_FP8, "gptq4": GPTQConfig(bits=4),
                   "gptq8": GPTQConfig(bits=8)}

BENCH_ENGINE_SETTINGS = ("dtype", "backend", "cuda_graph", "fused_ffn", "async_scheduling", "pre_dequant",
                         "enable_prefix_caching", "tensor_parallel_size", "kv_cache_dtype")


def bench_plan(args: argparse.Namespace, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The workload and EngineArgs of a bench run (no GPU needed): {"prompt_lens", "batch_sizes", "engine_config",
    "kv_tokens" (None without --kv-tokens), "notes" (what --kv-tokens capped, for the report)}.

    Without --kv-tokens the KV cache gets a byte budget that holds the largest decode batch with room to spare; with
    it, exactly ceil(N / block_size) blocks, and the workload is cut to what those hold (`kv_plan`)."""
    prompt_lens = [int(x) for x in args.prompt_lens.split(",") if x]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    seq_tokens = args.decode_prompt_len + args.decode_tokens
    block_size = EngineArgs.block_size
    plan: dict = {"kv_tokens": None, "notes": []}
    if args.kv_tokens is not None:
        fit = kv_plan(args.kv_tokens, block_size, prompt_lens, batch_sizes, args.decode_tokens,
                      args.decode_prompt_len)
        prompt_lens, batch_sizes = fit["prompt_lens"], fit["batch_sizes"]
        plan.update(kv_tokens=fit["kv_tokens"], notes=fit["notes"])
        kv_budget: dict = {"num_kv_blocks": fit["num_blocks"]}
    # The engine (sequences, KV cache) must also hold the speculative runs' batches.
    engine_batches = batch_sizes + (_ints(args.spec_batch_sizes)
                                    if getattr(args, "speculative", None) else []) \
        + (_ints(args.structured_batch_sizes) if getattr(args, "structured", None) else [])
    max_len = max(prompt_lens + [seq_tokens]) + 16
    if args.kv_tokens is None:
        kv_bytes = 2 * cfg.num_kv_layers * cfg.kv_size * dtype.itemsize * max(engine_batches) * (seq_tokens + 32)
        kv_budget = {}
    spec = _bench_spec_config(args, engine_batches)
    engine_config = engine_args_from_namespace(
        args, max_num_seqs=max(engine_batches), max_num_batched_tokens=max([8192] + prompt_lens), max_model_len=max_len,
        block_size=block_size, speculative_config=spec, **kv_budget)
    if args.kv_tokens is None:
        # Hybrid models: the linear-attention state pools (a slot per sequence, the graphs' scratch slot, the prefix
        # cache's snapshots and speculation's work slots) come out of the same budget; so does an MTP head's KV.
        work = spec["max_batch"] if spec is not None else 0
        slots = max(engine_batches) + 1 + engine_config.state_snapshots(cfg.is_hybrid) + work
        if spec is not None and spec["method"] == "mtp":
            kv_bytes += 2 * cfg.kv_size * dtype.itemsize * max(engine_batches) * (seq_tokens + 32)
        if spec is not None and cfg.is_hybrid:
            from orinfer.engine.state_rollback import StateRollback

            kv_bytes += StateRollback.buffer_bytes(cfg, work, spec["num_speculative_tokens"], dtype)
        kv_bytes += slots * cfg.state_bytes_per_sequence(dtype.itemsize) if cfg.is_hybrid else 0
        engine_config = engine_config.replace(kv_cache_bytes=max(kv_bytes, 2 * max_len * 2**20))
    plan["engine_config"] = engine_config
    plan.update(prompt_lens=prompt_lens, batch_sizes=batch_sizes)
    return plan


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _bench_spec_config(args: argparse.Namespace, engine_batches: list[int]) -> dict | None:
    """The engine's speculative_config for --speculative (None without): the engine is created with it, so that what
    it sizes at start (a hybrid model's rollback slots, an MTP head's KV cache) fits every measured batch; the plain
    measurements turn speculation off first."""
    if not getattr(args, "speculative", None):
        return None
    spec = {"method": args.speculative, "num_speculative_tokens": args.num_speculative_tokens,
            "max_batch": max(engine_batches)}
    if args.speculative == "draft_model":
        spec["model"] = args.draft_synthetic
    if getattr(args, "speculative_quantization", None):
        spec["quantization"] = args.speculative_quantization
    return spec


def run_from_args(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("error: orinfer bench needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    cfg = preset(args.synthetic) if args.synthetic else ModelConfig.from_hf(args.model)
    dtype, _ = resolve_dtype(args.dtype, device)
    name = args.synthetic or Path(args.model).name
    if args.quant:
        if not args.synthetic:
            print("error: --quant applies to --synthetic presets (a -m directory carries its own quantization)",
                  file=sys.stderr)
            return 2
        cfg.quantization = SYNTHETIC_QUANT[args.quant]
        name = f"{name}-{args.quant}"
    if args.pre_dequant:
        if cfg.quantization is None:
            print("error: --pre-dequant applies to AWQ models (--synthetic ... --quant awq, or an AWQ -m directory)",
                  file=sys.stderr)
            return 2
        name = f"{name}-predequant"
    if getattr(args, "speculative_quantization", None) and getattr(args, "speculative", None) not in ("mtp",
                                                                                                    "draft_model"):
        print("error: --speculative-quantization applies to --speculative mtp or draft_model", file=sys.stderr)
        return 2
    if getattr(args, "speculative", None) == "mtp":
        if not cfg.is_hybrid:
            print(f"error: --speculative mtp needs a Qwen3.5-family model (an MTP head); {name} is not one",
                  file=sys.stderr)
            return 2
        if args.synthetic:
            cfg.mtp_num_hidden_layers = 1  # the published checkpoints' one MTP layer, random like the rest
    skew = getattr(args, "moe_skew", False)
    if skew:
        if not cfg.num_experts or args.model or args.tensor_parallel_size > 1:
            print("error: --moe-skew takes a MoE preset (--synthetic qwen3-30b-a3b, qwen3.5-35b-a3b, ...) on one GPU",
                  file=sys.stderr)
            return 2
        name = f"{name}-skew"
    plan = bench_plan(args, cfg, dtype)
    if skew:
        plan["notes"].append("--moe-skew: every token routes to experts 0..k-1; the rooflines assume the uniform "
                             "spread (a skewed batch reads fewer expert bytes)")
    prompt_lens, batch_sizes, engine_config = plan["prompt_lens"], plan["batch_sizes"], plan["engine_config"]
    if args.kv_tokens is not None:
        name = f"{name}-kv{plan['kv_tokens']}"
    if args.decode_prompt_len != DECODE_PROMPT_LEN:
        name = f"{name}-ctx{args.decode_prompt_len}"
    if engine_config.kv_cache_dtype != "auto":
        name = f"{name}-kv{engine_config.kv_cache_dtype}"
    for note in plan["notes"]:
        log.warning("bench: %s", note)
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

    # Peak memory covers the orinfer run only (model build to the last decode), not the ceilings' buffers above.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    if args.model:
        from orinfer.llm import LLM

        llm = LLM(args.model, engine_config.replace(device="cuda"))
    else:
        draft = preset(args.draft_synthetic) if args.speculative == "draft_model" else None
        tokenizer = None
        if args.structured:
            from orinfer.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(args.structured)
        llm = build_synthetic_llm(cfg, dtype, device, engine_config, tokenizer=tokenizer, draft=draft)
    llm.engine.set_speculation(None)  # (created with --speculative's config: plain decoding first)
    # As `orinfer serve` does once loaded: full garbage collections then skip the start-up heap (torch, the model),
    # instead of walking it for ~0.1 s in the middle of a timed row (3 of them a speculation bench, NOTES run 383).
    freeze_startup_heap()
    model = llm.engine.parts.model
    if skew:
        route_every_token_to_the_first_experts(model)  # in place: the captured graphs read the same weights
    wbytes = weight_bytes(model)
    timings = bench_engine(llm, cfg, prompt_lens, batch_sizes, args.decode_tokens, args.decode_prompt_len)
    context, experts = args.decode_prompt_len + args.decode_tokens // 2, routed_expert_bytes(model)
    # Tensor parallelism: bytes and ceilings are one GPU's (rank 0's shard and its KV heads); FLOPs are shared by all.
    world, rank_cfg = engine_config.tensor_parallel_size, llm.engine.runner.model_config
    cache_elem = llm.engine.runner.cache_dtype.itemsize  # 1 with --kv-cache-dtype fp8
    per_token = decode_bytes_per_step(rank_cfg, wbytes, context, dtype.itemsize, 1, experts, world, cache_elem)
    read = result["ceilings"]["read_GBps"] * 1e9
    result["orinfer"] = {
        **timings, "weights_GiB": wbytes / 2**30, "bytes_per_decode_token": per_token,
        "roofline_tok_s": read / per_token,
        "kv_cache_GiB": llm.engine.runner.num_blocks * llm.engine.runner.bytes_per_block() / 2**30,
        "kv_cache_tokens": llm.engine.runner.num_blocks * llm.engine.runner.block_size,
        "kv_cache_dtype": str(llm.engine.runner.cache_dtype).removeprefix("torch."),
        # The tokens the KV byte budget holds at this cache dtype, before the pool is capped at what the workload can
        # use (kv_cache_tokens): the capacity figure of --kv-cache-dtype fp8 against 16 bits.
        "kv_budget_tokens": llm.engine.runner.kv_budget_blocks * llm.engine.runner.block_size,
        "pre_dequant_GiB": pre_dequant_bytes(model) / 2**30, "notes": plan["notes"],
        "peak_GiB": torch.cuda.max_memory_allocated(device) / 2**30,
        "backend": llm.engine.parts.ops.name, "cuda_graph": llm.engine.runner.graphs is not None,
        "tensor_parallel_size": world,
    }
    if args.speculative:
        from orinfer.bench.spec_bench import bench_speculation
        from orinfer.spec_decode.config import SpeculativeConfig

        spec = SpeculativeConfig(args.speculative, args.num_speculative_tokens,
                                 model=args.draft_synthetic if args.speculative == "draft_model" else None,
                                 quantization=getattr(args, "speculative_quantization", None))
        result["speculation"] = {"method": spec.method, "k": spec.num_speculative_tokens, "draft": spec.model,
                                 "quantization": spec.quantization, "rows": bench_speculation(
            llm, cfg, spec, [int(x) for x in args.spec_batch_sizes.split(",") if x], args.decode_tokens,
            args.decode_prompt_len)}
        name = result["model"] = f"{name}-spec-{spec.method}-k{spec.num_speculative_tokens}" + (
            f"-{spec.quantization}draft" if spec.quantization else "")
    if args.structured:
        from orinfer.bench.structured_bench import bench_structured

        result["structured"] = bench_structured(llm, cfg, _ints(args.structured_batch_sizes), args.decode_tokens,
                                                args.decode_prompt_len)
        name = result["model"] = f"{name}-structured"
    for batch, row in timings["decode"].items():
        # A step of `batch` rows reads the dense weights once, the routed experts its tokens hit, each row's KV.
        step_bytes = decode_bytes_per_step(rank_cfg, wbytes, context, dtype.itemsize, batch, experts, world,
                                           cache_elem)
        row["GBps"] = step_bytes / row["step_ms"] * 1e3 / 1e9
        row["pct_roofline"] = 100 * row["GBps"] * 1e9 / read
    for length, row in timings["prefill"].items():
        row["mfu_pct"] = 100 * row["tflops"] / (world * result["ceilings"]["matmul_TFLOPs"])
    llm.close()  # tensor parallelism: stops the workers before the HF baseline takes the GPUs
    del llm, model
    gc.unfreeze()  # the engine's reference cycles are collectable again, so its memory goes before the HF run
    gc.collect()
    torch.cuda.empty_cache()
    if args.compare_hf and not args.quant:  # HF has no AWQ kernels without autoawq: its baseline is the fp16 run
        from orinfer.bench.hf_baseline import bench_hf

        torch.cuda.reset_peak_memory_stats(device)
        result["hf"] = bench_hf(cfg, dtype, device, prompt_lens, args.decode_tokens, args.decode_prompt_len)
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
             f"Command: `{r['command']}`  ", f"torch {r['torch']}, backend {o['backend']}, CUDA graphs {o['cuda_graph']}"
             + (f", tensor parallel over {o['tensor_parallel_size']} GPUs (bytes, roofline and memory are one GPU's; "
                "MFU is of all of them)" if o.get("tensor_parallel_size", 1) > 1 else ""),
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
        if row.get("preemptions"):
            extra += f" ({row['preemptions']} preemptions: the KV cache was too small)"
        ref = hf["decode"].get(batch, hf["decode"].get(str(batch))) if hf else None
        lines.append(f"| decode batch {batch} tok/s | {row['tok_s']:.0f}{extra} | "
                     f"{ref['tok_s']:.1f} |" if ref else f"| decode batch {batch} tok/s | {row['tok_s']:.0f}{extra} | - |")
    lines.append(f"| weights / KV cache / peak GPU memory | {memory_cell(o)} | "
                 + (f"peak {hf['peak_gib']:.1f} GiB |" if hf else "- |"))
    lines.extend(["", "Peak GPU memory: torch.cuda.max_memory_allocated from the model build to the end of orinfer's "
                  "runs (reset after the ceilings)."])
    lines.extend(f"Note: {note}." for note in o.get("notes", ()))
    if "structured" in r:
        from orinfer.bench.structured_bench import structured_markdown

        lines.extend(structured_markdown(r["structured"]))
    if "speculation" in r:
        from orinfer.bench.spec_bench import speculation_markdown
        from orinfer.spec_decode.config import SpeculativeConfig

        s = r["speculation"]
        lines.extend(speculation_markdown(SpeculativeConfig(s["method"], s["k"], model=s.get("draft"),
                                                            quantization=s.get("quantization")), s["rows"]))
    if "vision" in r:
        from orinfer.bench.vision_bench import vision_markdown
        lines.extend(vision_markdown(r["vision"]))
    return "\n".join(lines) + "\n"


def memory_cell(o: dict) -> str:
    """"weights / KV cache / peak" in GiB, with the KV cache's tokens and any --pre-dequant copies spelled out."""
    weights = f"{o['weights_GiB']:.1f}"
    if o.get("pre_dequant_GiB"):
        weights += f" + {o['pre_dequant_GiB']:.1f} pre-dequant"
    kv = f"{o['kv_cache_GiB']:.2f}" if o['kv_cache_GiB'] < 1 else f"{o['kv_cache_GiB']:.1f}"
    if o.get("kv_cache_tokens"):
        kv += f" ({o['kv_cache_tokens']} tokens"
        if o.get("kv_cache_dtype"):
            kv += f", {o['kv_cache_dtype']}; the budget holds {o['kv_budget_tokens']}"
        kv += ")"
    return f"{weights} / {kv} / {o['peak_GiB']:.1f} GiB"


def write_report(result: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{result['model']}-{result['dtype']}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(result))
    return out_dir / f"{stem}.json"
