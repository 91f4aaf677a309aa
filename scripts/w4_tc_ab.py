#!/usr/bin/env python3
"""A/B (device): the tensor-core one-row W4 GEMV prototype (scripts/w4_tc_proto.py) against `w4_gemv`'s default on
Qwen3-8B's four projections: error against the fp32 reference, then time per call in graph replay over cold copies.
Usage: python3 scripts/w4_tc_ab.py"""
from __future__ import annotations

import torch

from gemv_sweep import time_graph
from orinfer.bench.ceilings import read_bandwidth
from orinfer.kernels.w4 import repack_awq, w4_gate_up_silu_ref, w4_linear_ref
from orinfer.kernels.w4_gemv import w4_gemv
from w4_sweep import GROUP, MIN_BYTES, SHAPES, random_awq
from w4_tc_proto import w4_tc_gemv

CONFIGS = [(16, 4), (16, 8), (32, 8), (16, 16), (32, 16)]


def main() -> None:
    dev = torch.device("cuda")
    read = read_bandwidth(dev)
    print(f"read bandwidth {read / 1e9:.0f} GB/s")
    print("| shape | kernel | max rel err | us | % read BW |\n| --- | --- | --- | --- | --- |")
    best: dict[str, float] = {}
    base: dict[str, float] = {}
    for name, (k, n, gated) in SHAPES.items():
        nbytes = k * n // 2 + (k // GROUP) * n * 3
        w4 = [repack_awq(*random_awq(k, n, dev), GROUP) for _ in range(max(2, MIN_BYTES // nbytes))]
        x = torch.randn(k, dtype=torch.bfloat16, device=dev)
        ref = (w4_gate_up_silu_ref if gated else w4_linear_ref)(x[None], w4[0]).float()[0]

        def report(label: str, fn) -> float:
            got = fn(w4[0]).float()
            err = ((got - ref).abs() / (ref.abs() + 1)).max().item()
            t = time_graph([lambda w=w: fn(w) for w in w4])
            print(f"| {name} | {label} | {err:.2e} | {t * 1e6:.1f} | {nbytes / t / read * 100:.0f}% |", flush=True)
            return t

        base[name] = report("w4_gemv default", lambda w: w4_gemv(x, w, gated=gated))
        for bn, warps in CONFIGS:
            if (k // 128) % warps:
                continue
            try:
                t = report(f"tc ({bn}, {warps})", lambda w, bn=bn, warps=warps: w4_tc_gemv(x, w, gated, bn, warps))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported and skipped
                print(f"| {name} | tc ({bn}, {warps}) | {type(exc).__name__}: {str(exc)[:80]} | | |")
                continue
            best[name] = min(best.get(name, 1.0), t)
        del w4
    print(f"per layer: w4_gemv {sum(base.values()) * 1e6:.1f} us, best tc {sum(best.values()) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
