"""FP8 block-wise kernel benchmark on Qwen3-8B shapes, against the bf16 kernels they replace, in one process:

  decode M = 1, 8   bf16 GEMV (kernels/gemv.py; fused gate/up + SwiGLU) vs the FP8 dispatch (kernels/fp8_ops.py), and
                    at M = 1 both FP8 one-row kernels (CUDA-core `fp8_gemv`, tensor-core `fp8_mm`): us, GB/s, % of the
                    read bandwidth measured in the same run, FP8 speedup; the per-layer sum (qkv + o + gate/up + down);
                    and the W8 dispatch (GPTQ-Int8's layout, groups of 128: kernels/w8_ops.py, the same kernels on
                    uint8 codes with zero points)
  M = 64            bf16 cuBLAS vs FP8 W8A16 (`fp8_mm`) vs W8A8 (quantize + Triton `fp8_gemm`, and + torch._scaled_mm)
                    vs the weight dequantised (`fp8_dequantize`) + cuBLAS
  M = 2048          bf16 cuBLAS vs W8A8 Triton vs torch._scaled_mm (each with and without the activation
                    quantization) vs dequantise + cuBLAS, TFLOP/s
  feed M = 8 .. 2048  FP8 activation feeding's producers (kernels/fp8_feed.py) against the unfused pair they replace:
                    RMSNorm + residual then `fp8_quantize_act` vs `rms_norm_fp8`, SwiGLU then `fp8_quantize_act` vs
                    `silu_and_mul_fp8` (speedup: over the unfused pair; 20 calls a graph, inputs L2-resident as in a
                    step, where the previous kernel has just written them)
--sweep adds every candidate tile of each FP8 kernel, per shape, for promoting defaults (the W8A8 GEMM's tiles fed by
TMA descriptors show `tma=True` at the end of their config, in the "fp8 W8A8 Triton (+quantize)" rows).

Timing: each op is captured in a CUDA graph over enough copies of its weights (rotated call after call, 4x the L2
size in all) that every call reads its weights from HBM, as a decode step does; a graph replays the calls back to
back (no launch gaps), the median of `--iters` replays is divided by the calls. Run:
`python -m orinfer.bench.fp8_kernels [--sweep] [--out DIR] [--json out.json]` (needs a CUDA device; importing this
module does not); --out writes DIR/fp8-kernels.md and DIR/fp8-kernels.json.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
from typing import Callable

import torch
import torch.nn.functional as F

from orinfer.bench.kernels import HIDDEN, INTER, VOCAB, read_bandwidth_gbps
from orinfer.bench.kernels import markdown as kernel_table
from orinfer.bench.kernels import report

SHAPES = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER),
          "lm_head": (VOCAB, HIDDEN)}
LAYER = ("qkv", "o", "gate_up", "down")
BLOCK = (128, 128)


def replay_us(calls: list[Callable[[], object]], iters: int) -> float:
    """Median microseconds per call: the calls, run once eagerly (compile, probe and tune outside the capture), then
    captured back to back in one CUDA graph and replayed `iters` times."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def graph_us(make_calls: Callable[[int], list[Callable[[], object]]], weight_bytes: int, iters: int) -> float:
    """Median microseconds per call: make_calls(copies) gives one call per weight copy; captured once, replayed."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return replay_us(make_calls(max(1, math.ceil(4 * l2 / max(weight_bytes, 1)))), iters)


W8_GROUP = 128   # GPTQ-Int8's usual group size


class Weights:
    """A shape's random bf16 weight (std 0.02), its FP8 block-wise form (`fp8_block_quantize`) and its W8 form
    (symmetric 8-bit codes per row and group of W8_GROUP inputs, the one zero point 128: what GPTQ-Int8 repacks to;
    codes and scales are what a call reads)."""

    def __init__(self, n: int, k: int, device: torch.device) -> None:
        from orinfer.kernels.fp8_block import fp8_block_quantize

        self.bf16 = (torch.randn(n, k, device=device) * 0.02).bfloat16()
        self.q, self.s = fp8_block_quantize(self.bf16, BLOCK)
        groups = self.bf16.float().view(n, k // W8_GROUP, W8_GROUP)
        scales = (groups.abs().amax(dim=2) / 127).clamp_min(1e-8).half()
        codes = (groups / scales.float()[:, :, None]).round().add(128).clamp(0, 255).to(torch.uint8).view(n, k)
        self.w8 = (codes, scales)

    def nbytes(self, form: str) -> int:
        """The bytes a call reads of this weight in `form` (bf16, fp8 or w8)."""
        tensors = {"bf16": (self.bf16,), "fp8": (self.q, self.s), "w8": self.w8}[form]
        return sum(t.numel() * t.element_size() for t in tensors)

    def copies(self, count: int, form: str) -> list[tuple[torch.Tensor, ...]]:
        tensors = {"bf16": (self.bf16,), "fp8": (self.q, self.s), "w8": self.w8}[form]
        return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(count - 1)]


def run_fp8_bench(device: str = "cuda", iters: int = 20, sweep: bool = False) -> list[dict]:
    """Rows of {section, op, shape, impl, us, bytes, GBps, pct_read_bw, TFLOPs, speedup (vs bf16), config}."""
    from orinfer.kernels import activation, fp8_dequant, fp8_gemm, fp8_gemv, fp8_mm, fp8_ops, gemv, w8_ops
    from orinfer.kernels.fp8_quant import fp8_quantize_act
    from orinfer.kernels.w8 import W8Weight

    dev = torch.device(device)
    torch.manual_seed(0)
    read_gbps = read_bandwidth_gbps(dev)
    rows: list[dict] = [{"section": "ceiling", "op": "read bandwidth (x.sum, 4 GiB fp32)", "shape": "", "impl": "torch",
                         "us": None, "bytes": 4 * 2**30, "GBps": read_gbps, "pct_read_bw": 100.0}]

    def add(section, op, shape, impl, us, nbytes, flops=None, base=None, config=""):
        row = {"section": section, "op": op, "shape": shape, "impl": impl, "us": us, "bytes": nbytes,
               "GBps": nbytes / us / 1e3, "pct_read_bw": 100.0 * nbytes / us / 1e3 / read_gbps, "config": config}
        if flops:
            row["TFLOPs"] = flops / us / 1e6
        if base:
            row["speedup"] = base / us
        rows.append(row)
        return us

    def timed(w: Weights, form: str, call: Callable[..., object]) -> float:
        return graph_us(lambda c: [lambda ws=ws: call(*ws) for ws in w.copies(c, form)], w.nbytes(form), iters)

    layer: dict[tuple[int, str], float] = {}
    for name, (n, k) in SHAPES.items():
        w = Weights(n, k, dev)
        gated = name == "gate_up"
        fp8_bytes, bf16_bytes = w.nbytes("fp8"), w.nbytes("bf16")
        for m in (1, 8):
            x = torch.randn(m, k, device=dev).bfloat16()
            act = m * (k + (n // 2 if gated else n)) * 2
            shape = f"M={m} N={n} K={k}" + (" +SwiGLU" if gated else "")
            bf16_fn = (lambda wb: activation.fused_gate_up_silu(x, wb)) if gated else (lambda wb: gemv.gemv(x, wb))
            base = add("decode", name, shape, "bf16 gemv", timed(w, "bf16", bf16_fn), bf16_bytes + act)
            fp8_fn = fp8_ops.fp8_gate_up_silu if gated else fp8_ops.fp8_block_linear
            us = add("decode", name, shape, "fp8 dispatch", timed(w, "fp8", lambda q, s: fp8_fn(x, q, s, BLOCK)),
                     fp8_bytes + act, base=base)
            w8_fn = w8_ops.w8_gate_up_silu if gated else w8_ops.w8_linear
            w8_us = add("decode", name, shape, "w8 dispatch (GPTQ-Int8)", timed(
                w, "w8", lambda c, sc: w8_fn(x, W8Weight(c, sc, 128, W8_GROUP))), w.nbytes("w8") + act, base=base)
            for form, t in (("bf16", base), ("fp8", us), ("w8", w8_us)):
                layer[(m, form)] = layer.get((m, form), 0.0) + (t if name in LAYER else 0.0)
            kernels = [("fp8_gemv (CUDA cores)", fp8_gemv.fp8_gemv, fp8_gemv.CANDIDATES)] if m == 1 else []
            kernels.append(("fp8_mm (tensor cores)", fp8_mm.fp8_mm, fp8_mm.CANDIDATES))
            for label, kernel, cands in kernels:
                for cfg in (cands if sweep else [None]):
                    fn = (lambda q, s, kernel=kernel, cfg=cfg: kernel(x, q, s, BLOCK, gated=gated, cfg=cfg))
                    add("decode", name, shape, label, timed(w, "fp8", fn), fp8_bytes + act, base=base,
                        config=str(cfg or "default"))
                    if sweep:   # the same tiles on W8's uint8 codes (its dispatch takes FP8's defaults)
                        fn = (lambda c, sc, kernel=kernel, cfg=cfg: kernel(
                            x, c, sc, (1, W8_GROUP), gated=gated, cfg=cfg, zeros=128))
                        add("decode", name, shape, f"w8 {label}", timed(w, "w8", fn), w.nbytes("w8") + act,
                            base=base, config=str(cfg))
        if name == "lm_head":
            continue
        for m in (64, 2048):
            x = torch.randn(m, k, device=dev).bfloat16()
            flops, act = 2 * m * n * k, m * (k + n) * 2
            section, shape = ("M=64", f"M={m} N={n} K={k}") if m == 64 else ("prefill", f"M={m} N={n} K={k}")
            base = add(section, name, shape, "bf16 cuBLAS", timed(w, "bf16", lambda wb: F.linear(x, wb)),
                       bf16_bytes + act, flops)
            if m == 64:
                for cfg in (fp8_mm.CANDIDATES if sweep else [None]):
                    add(section, name, shape, "fp8 W8A16 fp8_mm", timed(
                        w, "fp8", lambda q, s, cfg=cfg: fp8_mm.fp8_mm(x, q, s, BLOCK, cfg=cfg)), fp8_bytes + act,
                        flops, base, str(cfg or "default"))
            add(section, name, shape, "fp8 dequantize W + bf16 cuBLAS", timed(
                w, "fp8", lambda q, s: F.linear(x, fp8_dequant.fp8_dequantize(q, s, BLOCK))), fp8_bytes + act, flops,
                base)
            xq, xs = fp8_quantize_act(x, 128)
            add(section, name, shape, "fp8 quantize x only", graph_us(
                lambda c: [lambda: fp8_quantize_act(x, 128)], 1 << 40, iters), m * k * 3)
            for cfg in (fp8_gemm.CANDIDATES if sweep else [None]):
                def w8a8(q, s, cfg=cfg):
                    xq_, xs_ = fp8_quantize_act(x, 128)
                    return fp8_gemm.fp8_gemm(xq_, xs_[:m], q, s, BLOCK, torch.bfloat16, cfg=cfg)
                add(section, name, shape, "fp8 W8A8 Triton (+quantize)", timed(w, "fp8", w8a8), fp8_bytes + act,
                    flops, base, str(cfg or "default"))
            add(section, name, shape, "fp8 W8A8 Triton GEMM only", timed(w, "fp8", lambda q, s: fp8_gemm.fp8_gemm(
                xq, xs[:m], q, s, BLOCK, torch.bfloat16)), fp8_bytes + act, flops, base)
            if fp8_ops._scaled_mm_runs(dev):
                add(section, name, shape, "fp8 W8A8 torch._scaled_mm (+quantize)", timed(
                    w, "fp8", lambda q, s: fp8_ops.fp8_scaled_mm(*fp8_quantize_act(x, 128), q, s, torch.bfloat16)),
                    fp8_bytes + act, flops, base)
                add(section, name, shape, "fp8 W8A8 torch._scaled_mm only", timed(
                    w, "fp8", lambda q, s: fp8_ops.fp8_scaled_mm(xq, xs, q, s, torch.bfloat16)), fp8_bytes + act,
                    flops, base)
            else:
                rows.append({"section": section, "op": name, "shape": shape, "impl": "torch._scaled_mm: not run "
                             "(block-wise scales unsupported by this torch / GPU)", "us": None})
        del w
        torch.cuda.empty_cache()
    feed_rows(add, dev, iters)
    for m, form in itertools.product((1, 8), ("fp8", "w8")):
        rows.append({"section": "decode", "op": "layer (qkv + o + gate_up + down)", "shape": f"M={m}",
                     "impl": f"bf16 -> {form} dispatch", "us": layer[(m, form)], "bf16_us": layer[(m, "bf16")],
                     "speedup": layer[(m, "bf16")] / layer[(m, form)]})
    return rows


def feed_rows(add: Callable[..., float], dev: torch.device, iters: int) -> None:
    """The "feed" section (module docstring): `add(section, op, shape, impl, us, bytes, base=...)` per row."""
    from orinfer.kernels import activation, fp8_feed, norm
    from orinfer.kernels.fp8_quant import fp8_quantize_act

    w = (1.0 + 0.1 * torch.randn(HIDDEN, device=dev)).bfloat16()
    for m in (8, 64, 2048):
        x, r = (torch.randn(m, HIDDEN, device=dev).bfloat16() for _ in range(2))
        gate_up = torch.randn(m, 2 * INTER, device=dev).bfloat16()
        pairs = (("rms_norm + residual -> fp8", f"M={m} H={HIDDEN}", m * HIDDEN * 7,   # read x, r; write r', q
                  lambda: fp8_quantize_act(norm.rms_norm(x, w, 1e-6, r)[0], 128),
                  lambda: fp8_feed.rms_norm_fp8(x, w, 1e-6, r, 128), "rms_norm, fp8_quantize_act", "rms_norm_fp8"),
                 ("SwiGLU -> fp8", f"M={m} I={INTER}", m * INTER * 5,                  # read g, u; write q
                  lambda: fp8_quantize_act(activation.silu_and_mul(gate_up), 128),
                  lambda: fp8_feed.silu_and_mul_fp8(gate_up, 128), "silu_and_mul, fp8_quantize_act",
                  "silu_and_mul_fp8"))
        for op, shape, nbytes, unfused, fused, unfused_label, fused_label in pairs:
            base = add("feed", op, shape, unfused_label, replay_us([unfused] * 20, iters), nbytes)
            add("feed", op, shape, fused_label, replay_us([fused] * 20, iters), nbytes, base=base)


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table: `bench.kernels.markdown`'s, the section before each op."""
    return kernel_table([r | {"op": f"{r['section']}: {r['op']}"} for r in rows], speedup="speedup vs bf16 (FP8, W8)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time every candidate tile of each FP8 kernel")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--out", help="also write fp8-kernels.md (the table) and fp8-kernels.json (the rows) in this folder")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the FP8 kernel benchmark needs a CUDA device")
        return 1
    rows = run_fp8_bench(args.device, args.iters, args.sweep)
    out = (lambda ext: os.path.join(args.out, f"fp8-kernels.{ext}")) if args.out else (lambda ext: None)
    report(rows, markdown(rows), f"FP8 block-wise kernels vs bf16 on {{device}} (Qwen3-8B shapes, torch "
           f"{torch.__version__})", args.device, args.json or out("json"), out("md"), torch=torch.__version__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
