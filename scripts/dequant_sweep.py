#!/usr/bin/env python3
"""Sweep `w4_dequantize`'s tile (rows per program, chunks per program, warps) on Qwen3-8B's four projections (device):
time per call in graph replay over cold copies, GB/s of bytes moved (W4 read + 16-bit write) and % of the read
bandwidth. Usage: python3 scripts/dequant_sweep.py"""

from __future__ import annotations

import itertools

import torch

from gemv_sweep import time_graph  # same folder
from orinfer.bench.ceilings import read_bandwidth
from orinfer.kernels.w4 import repack_awq
from orinfer.kernels.w4_mma import w4_dequantize
from w4_sweep import GROUP, SHAPES, random_awq


def main() -> None:
    dev = torch.device("cuda")
    read = read_bandwidth(dev)
    print("| shape | block_n, chunks, warps | us | GB/s | % read BW |\n| --- | --- | --- | --- | --- |")
    for name, (k, n, _) in SHAPES.items():
        copies = [repack_awq(*random_awq(k, n, dev), GROUP) for _ in range(2)]
        moved = k * n // 2 + (k // GROUP) * n * 3 + k * n * 2
        ref = w4_dequantize(copies[0])
        rows = []
        for block_n, chunks, warps in itertools.product((8, 16, 32, 64), (1, 2, 4, 8), (4, 8)):
            try:
                assert torch.equal(w4_dequantize(copies[0], torch.bfloat16, block_n, chunks, warps), ref)
                t = time_graph([lambda c=c, b=block_n, ch=chunks, wp=warps: w4_dequantize(c, torch.bfloat16, b, ch, wp)
                                for c in copies])
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is skipped
                print(f"  {name} {(block_n, chunks, warps)}: {type(exc).__name__}")
                continue
            rows.append((t, (block_n, chunks, warps)))
        rows.sort()
        default = next(r for r in rows if r[1] == (16, 8, 4))
        for t, cfg in rows[:4] + [default]:
            print(f"| {name} | {cfg} | {t * 1e6:.1f} | {moved / t / 1e9:.0f} | {100 * moved / t / read:.1f} |")
        del copies, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
