#!/usr/bin/env python3
"""Sweep `w4_dequantize`'s tile (rows per program, chunks per program, warps) on Qwen3-8B's four projections (device):
time per call in graph replay over cold copies, GB/s of bytes moved (W4 read + 16-bit write) and % of the copy
ceiling; then the per-layer sum (qkv + o + gate_up + down) of the best tiles and of the default.
Usage: python3 scripts/dequant_sweep.py"""

from __future__ import annotations

import inspect
import itertools

import torch

from gemv_sweep import time_graph  # same folder
from orinfer.bench.ceilings import copy_bandwidth
from orinfer.kernels.w4 import repack_awq
from orinfer.kernels.w4_mma import w4_dequantize
from w4_sweep import GROUP, SHAPES, random_awq


def _default() -> tuple[int, int, int]:
    params = inspect.signature(w4_dequantize).parameters
    return params["block_n"].default, params["chunks"].default, params["num_warps"].default


def main() -> None:
    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    default = _default()
    print(f"copy ceiling {copy / 1e9:.0f} GB/s; default tile {default}")
    print("| shape | block_n, chunks, warps | us | GB/s | % copy |\n| --- | --- | --- | --- | --- |")
    results: dict[tuple[int, int, int], dict[str, float]] = {}
    for name, (k, n, _) in SHAPES.items():
        copies = [repack_awq(*random_awq(k, n, dev), GROUP) for _ in range(2)]
        moved = k * n // 2 + (k // GROUP) * n * 3 + k * n * 2
        ref = w4_dequantize(copies[0])
        rows = []
        for cfg in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8), (2, 4, 8)):
            if cfg[0] * cfg[1] > 64:
                continue
            try:
                assert torch.equal(w4_dequantize(copies[0], torch.bfloat16, *cfg), ref)
                t = time_graph([lambda c=c, cfg=cfg: w4_dequantize(c, torch.bfloat16, *cfg) for c in copies])
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is skipped
                print(f"  {name} {cfg}: {type(exc).__name__}")
                continue
            rows.append((t, cfg))
            results.setdefault(cfg, {})[name] = t
        rows.sort()
        for t, cfg in rows[:4] + [r for r in rows if r[1] == default]:
            print(f"| {name} | {cfg} | {t * 1e6:.1f} | {moved / t / 1e9:.0f} | {100 * moved / t / copy:.1f} |")
        del copies, ref
        torch.cuda.empty_cache()
    layer = sorted((sum(v.values()), cfg) for cfg, v in results.items() if len(v) == len(SHAPES))
    for t, cfg in layer[:5] + [(sum(results[default].values()), default)]:
        print(f"per layer (qkv + o + gate_up + down): {cfg} {t * 1e6:.1f} us")


if __name__ == "__main__":
    main()
