#!/usr/bin/env python3
"""A/B (device): the one-row W4 GEMV's integer step (`w4_gemv_int`, `kernels/w4_int_step.py`) against `w4_gemv`'s
default. First its accuracy against the fp32 reference beside `w4_gemv`'s, on inputs that stress the per-chunk 16-bit
x (outliers 1000x the rest, tiny values, fp16, bias, a non-finite x); then its tiles per Qwen3-8B projection
(scripts/one_row_ab.py). Usage: python3 scripts/w4_gemv_int_ab.py [OUT_JSON] (the best tile per kind: short, gated,
long)"""
from __future__ import annotations

import sys

import torch

from one_row_ab import run_ab
from orinfer.kernels.w4 import repack_awq, w4_gate_up_silu_ref, w4_linear_ref
from orinfer.kernels.w4_gemv import W4GemvConfig, w4_gemv, w4_gemv_int
from w4_sweep import random_awq

# (block_n, block_kp, warps) per shape
SHORT = [(16, 512, 4), (32, 512, 4), (8, 512, 4), (16, 512, 8), (32, 512, 8), (16, 256, 4)]
GATED = [(16, 512, 4), (8, 512, 4), (16, 512, 8), (32, 512, 8), (8, 512, 2)]
LONG = [(8, 512, 4), (16, 512, 4), (16, 512, 8), (4, 512, 4), (32, 512, 8)]
CONFIGS = {"qkv": SHORT, "o": SHORT, "gate_up": GATED, "down": LONG}


def candidates(name, x, w4, gated):
    return [(f"int {c}", lambda i, c=c: w4_gemv_int(x, w4[i], gated=gated, cfg=W4GemvConfig(*c)), list(c))
            for c in CONFIGS[name]]


def accuracy() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print("| case | w4_gemv max rel err | w4_gemv_int max rel err |\n| --- | --- | --- |")
    for k, n, dtype, gated, kind in [(4096, 1000, torch.bfloat16, False, "randn"),
                                     (4096, 1000, torch.bfloat16, False, "outliers"),
                                     (4096, 1000, torch.bfloat16, False, "tiny"),
                                     (1536, 77 * 8, torch.float16, False, "randn"),
                                     (12288, 512, torch.bfloat16, False, "outliers"),
                                     (4096, 2048, torch.bfloat16, True, "outliers"),
                                     (4096, 1000, torch.bfloat16, False, "bias")]:
        w = repack_awq(*random_awq(k, n, dev), 128)
        x = torch.randn(k, device=dev)
        if kind == "outliers":
            x[torch.randperm(k, device=dev)[:8]] *= 1000
        if kind == "tiny":
            x *= 1e-30
        x = x.to(dtype)
        bias = torch.randn(n, device=dev).to(dtype) if kind == "bias" else None
        ref = (w4_gate_up_silu_ref(x[None], w) if gated else w4_linear_ref(x[None], w, bias)).float()[0]
        errs = []
        for fn in (w4_gemv, w4_gemv_int):
            got = fn(x, w, bias, gated).float()
            errs.append(((got - ref).abs() / (ref.abs() + ref.abs().mean())).max().item())
        print(f"| {k}x{n} {str(dtype)[6:]} {'gated ' if gated else ''}{kind} | {errs[0]:.2e} | {errs[1]:.2e} |")
    w = repack_awq(*random_awq(4096, 512, dev), 128)
    x = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    x[5] = float("inf")
    got = w4_gemv_int(x, w)
    print("inf in x -> non-finite outputs:", (~torch.isfinite(got)).sum().item(), "of", got.numel(),
          "(w4_gemv:", (~torch.isfinite(w4_gemv(x, w))).sum().item(), ")")


if __name__ == "__main__":
    accuracy()
    run_ab(candidates, sys.argv[1] if len(sys.argv) > 1 else None)
