"""Sweep the W4-layout INT4 kernels (`kernels/w4_gemv.py`, `kernels/w4_mma.py`) on Qwen3-8B shapes the way decode
runs them: a CUDA graph of back-to-back launches over different weight copies (cold in L2), after checking each
config against the torch reference. Usage (device): python3 scripts/w4_sweep.py [ROWS ...] (default 1);
AWQ_SWEEP_SHAPES=qkv,o limits the shapes, W4_SWEEP_GEMV=default sweeps only the MMA configs against the default GEMV, W4_SWEEP_MMA=none only the GEMVs
-> per shape and row count, the fastest configs in us, GB/s of weight bytes and % of read bandwidth; the old AWQ-layout
kernel's numbers (before the W4 layout) are in benchmarks/awq_sweep_h200.md."""

from __future__ import annotations

import itertools
import os
import sys

import torch

from gemv_sweep import time_graph  # same folder: the graph-replay timer of the dense sweep
from orinfer.bench.ceilings import read_bandwidth
from orinfer.kernels.w4 import repack_awq, w4_gate_up_silu_ref, w4_linear_ref
from orinfer.kernels.w4_gemv import DEFAULT_GEMV, GEMV_CONFIGS, W4GemvConfig, w4_gemv
from orinfer.kernels.w4_mma import MMA_CONFIGS, w4_mma

EXTRA_GEMV = [W4GemvConfig(bn, kp, w) for bn, kp, w in [(4, 512, 8), (8, 512, 8), (4, 1024, 8), (8, 256, 8),
                                                        (16, 256, 8), (8, 512, 4), (4, 256, 2), (2, 512, 1)]]

SHAPES = {"qkv": (4096, 6144, False), "o": (4096, 4096, False), "gate_up": (4096, 24576, True),
          "down": (12288, 4096, False)}
GROUP = 128
MIN_BYTES = 400 << 20


def random_awq(k: int, n: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2**31, 2**31 - 1, (k // GROUP, n // 8), dtype=torch.int32, device=dev)
    sc = (torch.rand(k // GROUP, n, device=dev) * 0.01 + 0.001).half()
    return qw, qz, sc


def report_registers() -> list[str]:
    from orinfer.kernels import w4_gemv
    lines = []
    from orinfer.kernels import w4_mma
    for kernel in (w4_gemv._w4_gemv_kernel, w4_mma._w4_mma_kernel):
        for caches in getattr(kernel, "device_caches", {}).values():
            for key, compiled in caches[0].items():
                lines.append(f"{kernel.fn.__name__} warps={compiled.metadata.num_warps} regs={compiled.n_regs} "
                             f"spills={compiled.n_spills} key={str(key)[-120:]}")
    return lines


def main() -> None:
    dev = torch.device("cuda")
    row_counts = [int(a) for a in sys.argv[1:]] or [1]
    read = read_bandwidth(dev)
    print(f"read bandwidth {read / 1e9:.0f} GB/s")
    lines = ["| shape | rows | kernel config | us | GB/s | % read BW |", "| --- | --- | --- | --- | --- | --- |"]
    only = os.environ.get("AWQ_SWEEP_SHAPES")
    shapes = {k: v for k, v in SHAPES.items() if not only or k in only.split(",")}
    for (name, (k, n, gated)), rows in itertools.product(shapes.items(), row_counts):
        nbytes = k * n // 2 + (k // GROUP) * n * 3
        awq = [random_awq(k, n, dev) for _ in range(max(2, MIN_BYTES // nbytes))]
        w4 = [repack_awq(*w, GROUP) for w in awq]
        x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
        ref = (w4_gate_up_silu_ref if gated else w4_linear_ref)(x, w4[0]).float()
        results = []
        if rows > 16:  # prefill: the dense bf16 GEMM (cuBLAS) is the ceiling to compare with
            dense = torch.randn(n, k, dtype=torch.bfloat16, device=dev)
            t = time_graph([lambda: torch.nn.functional.linear(x, dense)] * 4)
            results.append((t, "dense bf16 cuBLAS (reference)"))
            del dense
        gemv_cfgs = [DEFAULT_GEMV] if os.environ.get("W4_SWEEP_GEMV") == "default" else GEMV_CONFIGS + EXTRA_GEMV
        kernels = [(w4_gemv, c) for c in gemv_cfgs] if rows == 1 else []
        if os.environ.get("W4_SWEEP_MMA") != "none":
            kernels += [(w4_mma, c) for c in MMA_CONFIGS if c.block_m <= max(16, rows)]
        for kernel, cfg in kernels:
            try:
                got = kernel(x, w4[0], gated=gated, cfg=cfg).float()
                err = ((got - ref).abs() / (ref.abs() + 1)).max().item()
                copies = w4[:8] if rows > 16 else w4
                t = time_graph([lambda w=w, c=cfg: kernel(x, w, gated=gated, cfg=c) for w in copies])
            except Exception as exc:  # noqa: BLE001 - configs that do not compile are skipped
                print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[-1500:]}", file=sys.stderr)
                continue
            results.append((t, f"{kernel.__name__} {tuple(cfg)} err {err:.1e}"))
        results.sort(key=lambda r: r[0])
        for t, what in results[:6] + [r for r in results[6:] if r[1].startswith("dense")]:
            lines.append(f"| {name} {k}x{n} | {rows} | {what} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | "
                         f"{100 * nbytes / t / read:.1f} |")
        print("\n".join(lines[-7:]), flush=True)
        del awq, w4
        torch.cuda.empty_cache()
    print("\n".join(lines))
    print("\n".join(report_registers()))


if __name__ == "__main__":
    main()
