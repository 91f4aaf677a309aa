"""Sweep GEMV launch configs on Qwen3-8B decode shapes the way decode runs them: a CUDA graph of back-to-back
launches, each over a different weight copy (cold in L2), so neither launch overhead nor cache hits flatter a config.
Usage (device): python3 scripts/gemv_sweep.py [ROWS]  -> GB/s and % of read bandwidth per shape and config (ROWS: the
decode batch, default 1; the FMA loop serves one row only, so several rows sweep the DOT loop and cuBLAS)."""

from __future__ import annotations

import itertools
import sys

import torch

from orinfer.bench.ceilings import read_bandwidth
from orinfer.kernels.gemv import CUBLAS, GemvConfig, launch_gemv

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (24576, 4096, True),
          "down": (4096, 12288, False)}
COPIES = 24


def time_graph(fn_list) -> float:
    graph = torch.cuda.CUDAGraph()
    for fn in fn_list:  # warm-up / compile outside capture
        fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for fn in fn_list:
            fn()
    times = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1000 / len(fn_list))
    return sorted(times)[3]


def main() -> None:
    dev = torch.device("cuda")
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    read = read_bandwidth(dev)
    print(f"read bandwidth {read / 1e9:.0f} GB/s")
    fma = [GemvConfig(False, n, k, w, 1) for n, k, w in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048),
                                                                          (2, 4, 8)) if n * k <= 16384]
    dot = [GemvConfig(True, n, k, 4, st) for n, k, st in itertools.product((32, 64, 128), (64, 128, 256), (2, 3, 4))]
    rows = []
    for name, (n, k, gated) in SHAPES.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) / 64 for _ in range(COPIES)]
        x = torch.randn(batch, k, dtype=torch.bfloat16, device=dev)
        n_out = n // 2 if gated else n
        results = []
        for cfg in (fma if batch == 1 else []) + dot + [CUBLAS]:
            try:
                t = time_graph([lambda w=w, c=cfg: launch_gemv(x, w, None, n_out, gated, c) for w in ws])
            except Exception as exc:  # noqa: BLE001 - configs that do not fit are skipped
                print(f"  {name} {cfg}: {type(exc).__name__}", file=sys.stderr)
                continue
            results.append((t, cfg))
        results.sort(key=lambda r: r[0])
        nbytes = n * k * 2
        for t, cfg in results[:6] + [r for r in results if r[1] == CUBLAS]:
            rows.append(f"| {name} {n}x{k} B={batch} | {cfg} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | {100 * nbytes / t / read:.1f} |")
        del ws
        torch.cuda.empty_cache()
    print("| shape | config | us | GB/s | % read BW |\n| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
