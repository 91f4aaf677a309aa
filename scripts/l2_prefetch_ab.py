#!/usr/bin/env python3
"""A/B (device): does prefetching the next GEMV's weights into L2 during a latency-bound phase pay? Per Qwen3-8B
projection, graph replay of [prefetch kernel; spin SPIN_US; W4 GEMV] against [spin SPIN_US; W4 GEMV] (the spin
stands for the short kernels before the GEMV: RoPE, attention, combine or a norm; HBM is idle there), over cold weight
copies; also the GEMV alone with its weights already warm in L2 (the same copy every call).
Usage: python3 scripts/l2_prefetch_ab.py [SPIN_US ...]"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from gemv_sweep import time_graph
from orinfer.kernels.w4 import repack_awq
from orinfer.kernels.w4_gemv import _globaltimer, w4_gemv
from w4_sweep import GROUP, MIN_BYTES, SHAPES, random_awq


@triton.jit
def _prefetch_l2(ptr, n_lines, LINES: tl.constexpr):
    """Each program asks L2 for LINES 128-byte lines (evict_last) of [ptr, ptr + 128 n_lines)."""
    i = tl.program_id(0) * LINES + tl.arange(0, LINES)
    addr = ptr.to(tl.pointer_type(tl.int8)) + tl.minimum(i, n_lines - 1).to(tl.int64) * 128
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor, programs: int = 528) -> None:
    n_lines = triton.cdiv(t.numel() * t.element_size(), 128)
    lines = triton.next_power_of_2(triton.cdiv(n_lines, programs))
    _prefetch_l2[(triton.cdiv(n_lines, lines),)](t, n_lines, LINES=lines, num_warps=4)


@triton.jit
def _spin(out_ptr, ns):
    t0 = _globaltimer(ns)
    t = t0
    while t - t0 < ns:
        t = _globaltimer(ns)
    tl.store(out_ptr, t - t0)


def main() -> None:
    dev = torch.device("cuda")
    spins = [float(a) for a in sys.argv[1:]] or [4.0, 8.0]
    sink = torch.zeros(1, dtype=torch.int64, device=dev)
    print("| shape | spin us | GEMV after spin (cold) | prefetch + spin + GEMV | GEMV warm in L2 |\n"
          "| --- | --- | --- | --- | --- |")
    for name, (k, n, gated) in SHAPES.items():
        nbytes = k * n // 2 + (k // GROUP) * n * 3
        w4 = [repack_awq(*random_awq(k, n, dev), GROUP) for _ in range(max(2, MIN_BYTES // nbytes))]
        x = torch.randn(k, dtype=torch.bfloat16, device=dev)
        warm = time_graph([lambda: w4_gemv(x, w4[0], gated=gated)] * 8)
        for spin in spins:
            ns = int(spin * 1000)
            base = time_graph([lambda i=i: (_spin[(1,)](sink, ns), w4_gemv(x, w4[i], gated=gated))
                               for i in range(len(w4))])
            pre = time_graph([lambda i=i: (prefetch_l2(w4[i].packed), prefetch_l2(w4[i].scales),
                                           prefetch_l2(w4[i].zeros), _spin[(1,)](sink, ns),
                                           w4_gemv(x, w4[i], gated=gated)) for i in range(len(w4))])
            print(f"| {name} | {spin:.0f} | {(base - spin * 1e-6) * 1e6:.1f} | {(pre - spin * 1e-6) * 1e6:.1f} "
                  f"| {warm * 1e6:.1f} |", flush=True)
        del w4
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
