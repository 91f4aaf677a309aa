"""Logit error of an FP8 block-wise model against the fp32 model of its dequantised weights, beside the error of the
16-bit model of the same weights (issue 32's accuracy figure: FP8's error no larger than bf16's own).

One set of random FP8 weights of a preset's shapes (`loader.random_model`, codes ~ N(0, 1) times block scales) defines
the model. Its dequantised weights (fp32) are copied into two models of the same architecture without quantization:
one run in fp32 (the reference; the torch backend, TF32 off) and one whose weights are those values rounded to the
activation dtype (the "16-bit model"). The FP8 model runs the engine's own kernels (triton backend) in that dtype,
once with the default paths (prefill W8A8: x quantized per token and 128-group) and once with x kept in 16 bits
everywhere, as ORINFER_FP8_ACTIVATIONS=16bit runs it (W8A16). Every model sees the same prompt (random token ids)
through the paged path (`engine.logits_probe.paged_logits`): a prefill of `--prompt-len` tokens, then `--decode`
decode steps. Reported per model, for the prompt's rows and for the decode rows: the largest absolute logit error and the
RMS error, both over the reference logits' RMS, and how often the arg-max token differs from the reference's.

    python -m orinfer.bench.fp8_accuracy --synthetic qwen3-8b [--prompt-len 512] [--decode 16] [--dtype bfloat16]

A CUDA device runs it (the fp32 reference of Qwen3-8B takes 33 GB); `--device cpu` with a small preset checks the
tool itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from torch import nn

from orinfer.args import EngineArgs
from orinfer.config import ModelConfig, preset
from orinfer.engine.llm_engine import EngineParts
from orinfer.engine.logits_probe import paged_logits
from orinfer.kernels import fp8_ops, moe_a8
from orinfer.layers.fp8_linear import FP8Linear
from orinfer.layers.ops import get_ops
from orinfer.llm import LLM
from orinfer.loader import random_model
from orinfer.models.registry import build_model
from orinfer.fp8_config import SYNTHETIC_FP8


def fp8_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, backend: str, seed: int) -> nn.Module:
    """Random block-wise FP8 weights of cfg's shapes (128 x 128 blocks), activations in `dtype`."""
    return random_model(dataclasses.replace(cfg, quantization=SYNTHETIC_FP8), get_ops(backend, device), dtype, dtype,
                        device, seed=seed)


def dequantised_twin(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, backend: str
                     ) -> nn.Module:
    """The same architecture without quantization, its weights the FP8 model's dequantised ones rounded once to
    `dtype` (fp32 products of codes and scales); every 16-bit parameter (embeddings, norms, lm_head) copied."""
    twin = build_model(dataclasses.replace(cfg, quantization=None), get_ops(backend, device), dtype, dtype, device)
    fp8 = {name: module for name, module in model.named_modules() if isinstance(module, FP8Linear)}
    with torch.no_grad():
        for name, module in fp8.items():
            twin.get_submodule(name).weight.copy_(module.dequantized_weight(torch.float32).to(dtype))
        own = dict(twin.named_parameters())
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[0] not in fp8:
                own[name].copy_(param.to(dtype))
    return twin


def _llm(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, backend: str) -> LLM:
    parts = EngineParts(model, cfg, None, {}, device, dtype, ops=get_ops(backend, device))
    return LLM.from_parts(parts, EngineArgs(device=device.type, num_kv_blocks=64, block_size=16, cuda_graph=False,
                                            max_num_seqs=1, progress=False))


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Largest and RMS absolute error over the reference's RMS, and the share of rows whose arg-max differs."""
    got, ref = got.double(), ref.double()
    scale = ref.pow(2).mean().sqrt().item()
    diff = got - ref
    return {"max_err": diff.abs().max().item() / scale, "rms_err": diff.pow(2).mean().sqrt().item() / scale,
            "argmax_diff": (got.argmax(-1) != ref.argmax(-1)).double().mean().item()}


def measure(cfg: ModelConfig, name: str, prompt_len: int, decode: int, dtype: torch.dtype, device: torch.device,
            seed: int) -> dict:
    """The report (module docstring) for a model of cfg's shapes, named `name` in it."""
    backend = "triton" if device.type == "cuda" else "torch"
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, cfg.vocab_size - 100, (prompt_len + decode,), generator=gen).tolist()
    fp8 = fp8_model(cfg, dtype, device, backend, seed)
    models = {"fp32 reference": dequantised_twin(fp8, cfg, torch.float32, device, "torch"),
              f"{str(dtype).removeprefix('torch.')} model": dequantised_twin(fp8, cfg, dtype, device, backend)}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        logits = {label: paged_logits(_llm(model, cfg, model_dtype, device, model_backend), ids, prompt_len)
                  for (label, model), model_dtype, model_backend in zip(
                      models.items(), (torch.float32, dtype), ("torch", backend))}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    del models
    fp8_llm = _llm(fp8, cfg, dtype, device, backend)
    logits["FP8 (default paths)"] = paged_logits(fp8_llm, ids, prompt_len)
    before = fp8_ops.PREFILL, fp8_ops.SMALL_M, moe_a8.MODE
    fp8_ops.PREFILL, fp8_ops.SMALL_M, moe_a8.MODE = "dequant", "w8a16", "w8a16"   # what the 16bit setting picks
    try:
        logits["FP8, x in 16 bits (ORINFER_FP8_ACTIVATIONS=16bit)"] = paged_logits(fp8_llm, ids, prompt_len)
    finally:
        fp8_ops.PREFILL, fp8_ops.SMALL_M, moe_a8.MODE = before
    ref = logits.pop("fp32 reference")
    return {"preset": name, "dtype": str(dtype).removeprefix("torch."), "prompt_len": prompt_len, "decode": decode,
            "seed": seed, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "rows": {label: {"prompt": errors(got[:prompt_len], ref[:prompt_len]),
                             "decode": errors(got[prompt_len:], ref[prompt_len:])} for label, got in logits.items()}}


def markdown(report: dict) -> str:
    lines = [f"## FP8 logit error, {report['preset']} ({report['dtype']}, {report['device']})", "",
             f"Prompt {report['prompt_len']} tokens, {report['decode']} decode steps, seed {report['seed']}; errors "
             "against the fp32 model of the dequantised weights, over its logits' RMS.", "",
             "| model | prompt max | prompt RMS | prompt arg-max differs | decode max | decode RMS | decode arg-max differs |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, rows in report["rows"].items():
        p, d = rows["prompt"], rows["decode"]
        lines.append(f"| {label} | {p['max_err']:.2e} | {p['rms_err']:.2e} | {p['argmax_diff']:.1%} | "
                     f"{d['max_err']:.2e} | {d['rms_err']:.2e} | {d['argmax_diff']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orinfer.bench.fp8_accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--synthetic", default="qwen3-8b", help="preset of the shapes (default qwen3-8b)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode", type=int, default=16, help="decode steps after the prompt")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="only the first N layers of the preset")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of markdown")
    args = p.parse_args(argv)
    cfg, name = preset(args.synthetic), args.synthetic
    if args.layers:
        cfg, name = dataclasses.replace(cfg, num_hidden_layers=args.layers), f"{name} ({args.layers} layers)"
    report = measure(cfg, name, args.prompt_len, args.decode, getattr(torch, args.dtype), torch.device(args.device),
                     args.seed)
    print(json.dumps(report, indent=1) if args.json else markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
