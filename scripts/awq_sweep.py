"""Sweep AWQ decode launch configs on Qwen3-8B shapes the way decode runs them: a CUDA graph of back-to-back
launches, each over a different weight copy (cold in L2). Usage (device): python3 scripts/awq_sweep.py [ROWS ...]
-> per shape and row count, the fastest configs in us, GB/s of weight bytes and % of read bandwidth."""

from __future__ import annotations

import itertools
import os
import sys

import torch

from gemv_sweep import time_graph  # same folder: the graph-replay timer of the dense sweep
from orinfer.bench.ceilings import read_bandwidth
from orinfer.kernels import awq as K

SHAPES = {"qkv": (4096, 6144, False), "o": (4096, 4096, False), "gate_up": (4096, 24576, True),
          "down": (12288, 4096, False)}
GROUP = 128
MIN_BYTES = 400 << 20
MODE = "configs"  # weight copies per shape: enough to overflow the 50 MB L2 many times


def candidates_stages(rows: int) -> list[K.AWQConfig]:
    """Second sweep: pipelining depth, explicit K splits and warps for the one-row kernels."""
    return [K.AWQConfig("fma", 1, bn, bk, sk, w, 1, u) for bn, bk, sk, w, u in itertools.product(
        (128, 256, 512), (8, 16, 32), (0, 4, 16), (4, 8), (1, 2, 4)) if bn * bk <= 8192 and bk * u <= 128]


def report_registers() -> list[str]:
    """Registers and spills of every compiled variant of the decode kernels (occupancy is a suspect)."""
    from orinfer.kernels import awq_decode as D
    lines = []
    for kernel in (K._awq_fma_kernel, D._nibble_mma_kernel, K._awq_mm_kernel):
        for caches in getattr(kernel, "device_caches", {}).values():
            for key, compiled in caches[0].items():
                lines.append(f"{kernel.fn.__name__} warps={compiled.metadata.num_warps} "
                             f"stages={compiled.metadata.num_stages} regs={compiled.n_regs} "
                             f"spills={compiled.n_spills} key={str(key)[-160:]}")
    return lines


def candidates(rows: int) -> list[K.AWQConfig]:
    if MODE == "stages":
        return candidates_stages(rows)
    nmma = [K.AWQConfig("nmma", 16, bn, bk, 0, 4, st) for bn, bk, st in itertools.product(
        (64, 128, 256), (64, 128), (2, 3))]
    if rows > 1:
        return K.DECODE_MMA_CONFIGS + nmma
    return K.FMA_CONFIGS + K.DECODE_MMA_CONFIGS + nmma


def random_awq(k: int, n: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2**31, 2**31 - 1, (k // GROUP, n // 8), dtype=torch.int32, device=dev)
    sc = (torch.rand(k // GROUP, n, device=dev) * 0.01 + 0.001).half()
    return qw, qz, sc


def main() -> None:
    global MODE
    dev = torch.device("cuda")
    args = sys.argv[1:]
    if args and args[0] == "stages":
        MODE, args = "stages", args[1:]
    row_counts = [int(a) for a in args] or [1, 16]
    read = read_bandwidth(dev)
    print(f"read bandwidth {read / 1e9:.0f} GB/s")
    lines = ["| shape | rows | config | us | GB/s | % read BW |", "| --- | --- | --- | --- | --- | --- |"]
    only = os.environ.get("AWQ_SWEEP_SHAPES")  # e.g. "gate_up,down"
    shapes = {k: v for k, v in SHAPES.items() if not only or k in only.split(",")}
    for (name, (k, n, gated)), rows in itertools.product(shapes.items(), row_counts):
        nbytes = k * n // 2 + (k // GROUP) * n * 2 + (k // GROUP) * n // 2
        copies = [random_awq(k, n, dev) for _ in range(max(2, MIN_BYTES // nbytes))]
        x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
        fn = K.awq_fused_gate_up_silu if gated else K.awq_linear
        results = []
        for cfg in candidates(rows):
            try:
                t = time_graph([lambda w=w, c=cfg: fn(x, *w, GROUP, cfg=c) for w in copies])
            except Exception as exc:  # noqa: BLE001 - configs that do not compile or fit are skipped
                print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[-300:]}", file=sys.stderr)
                continue
            results.append((t, cfg))
        results.sort(key=lambda r: r[0])
        for t, cfg in results[:5]:
            lines.append(f"| {name} {k}x{n} | {rows} | {tuple(cfg)} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | "
                         f"{100 * nbytes / t / read:.1f} |")
        print("\n".join(lines[-5:]), flush=True)
        del copies
        torch.cuda.empty_cache()
    print("\n".join(lines))
    print("\n".join(report_registers()))


if __name__ == "__main__":
    main()
