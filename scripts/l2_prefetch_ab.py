#!/usr/bin/env python3
"""A/B (device): does prefetching the next GEMV's weights into L2 during a latency-bound phase pay? Per Qwen3-8B
projection, graph replay of [spin SPIN_US; W4 GEMV] with the weights' bulk prefetch (kernels/l2_prefetch.py) forked
onto a side stream as the spin starts, against the same without it (the spin stands for the short kernels before the
GEMV: RoPE, attention, combine or a norm; HBM is idle there), over cold weight copies; also the GEMV alone with its
weights already warm in L2 (the same copy every call).
Usage: python3 scripts/l2_prefetch_ab.py [SPIN_US ...]"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from gemv_sweep import time_graph
from orinfer.kernels.l2_prefetch import PrefetchPlan
from orinfer.kernels.w4 import W4Weight, repack_awq
from orinfer.kernels.w4_gemv import _globaltimer, w4_gemv
from w4_sweep import GROUP, MIN_BYTES, SHAPES, random_awq


@triton.jit
def _spin(out_ptr, ns):
    t0 = _globaltimer(ns)
    t = t0
    while t - t0 < ns:
        t = _globaltimer(ns)
    tl.store(out_ptr, t - t0)


def main() -> None:
    dev = torch.device("cuda")
    spins = [float(a) for a in sys.argv[1:]] or [2.0, 4.0, 6.0]
    sink = torch.zeros(1, dtype=torch.int64, device=dev)
    side = torch.cuda.Stream(dev)

    def forked(plan: PrefetchPlan, ns: int, x: torch.Tensor, w4: W4Weight, gated: bool) -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            plan.launch()
        _spin[(1,)](sink, ns)
        w4_gemv(x, w4, gated=gated)
        main.wait_stream(side)

    print("| shape | spin us | request KB | GEMV after spin (cold) | prefetch on a side stream during the spin "
          "| GEMV warm in L2 |\n| --- | --- | --- | --- | --- | --- |")
    for name, (k, n, gated) in SHAPES.items():
        if name not in ("qkv", "o", "down"):
            continue
        nbytes = k * n // 2 + (k // GROUP) * n * 3
        w4 = [repack_awq(*random_awq(k, n, dev), GROUP) for _ in range(max(2, MIN_BYTES // nbytes))]
        x = torch.randn(k, dtype=torch.bfloat16, device=dev)
        warm = time_graph([lambda: w4_gemv(x, w4[0], gated=gated)] * 8)
        for spin in spins:
            ns = int(spin * 1000)
            base = time_graph([lambda i=i: (_spin[(1,)](sink, ns), w4_gemv(x, w4[i], gated=gated))
                               for i in range(len(w4))])
            for kb in (4, 16, 64, 256):
                plans = [PrefetchPlan(w[:3], kb << 10) for w in w4]
                pre = time_graph([lambda i=i: forked(plans[i], ns, x, w4[i], gated) for i in range(len(w4))])
                print(f"| {name} | {spin:.0f} | {kb} | {(base - spin * 1e-6) * 1e6:.1f} "
                      f"| {(pre - spin * 1e-6) * 1e6:.1f} | {warm * 1e6:.1f} |", flush=True)
        del w4
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
