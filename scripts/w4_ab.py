"""W4 MMA tile configs (orinfer.kernels.w4_mma) against the one-row GEMV and, for more than 32 rows, the
dequantise + cuBLAS path, per Qwen3-8B shape and row count, in one process (graph replay over cold weight copies,
each result checked against the fp32 reference first). Usage (device): python3 scripts/w4_ab.py [ROWS ...].
Runs 47-49 also timed the previous kernel (a copy of HEAD's module) the same way: benchmarks/NOTES.md."""
from __future__ import annotations

import sys

import torch

from gemv_sweep import time_graph
from orinfer.bench.ceilings import read_bandwidth
from orinfer.kernels.w4 import repack_awq, w4_gate_up_silu_ref, w4_linear_ref
from orinfer.kernels.w4_gemv import w4_gemv
from orinfer.kernels.w4_mma import W4MmaConfig, w4_mma
from orinfer.kernels.w4_ops import w4_gate_up_silu, w4_linear
from w4_sweep import GROUP, MIN_BYTES, SHAPES, random_awq

NEW = [W4MmaConfig(*c) for c in [(16, 128, 4, 3, 8), (16, 128, 4, 3, 4), (16, 128, 4, 3, 8, False),
                                 (16, 64, 4, 3, 8, False), (16, 128, 4, 4, 8), (16, 128, 4, 3, 16)]]
NEW32 = [W4MmaConfig(*c) for c in [(32, 128, 8, 3, 4, False), (32, 128, 4, 3, 4), (32, 128, 4, 3, 8)]]
BIG = [W4MmaConfig(*c) for c in [(64, 128, 8, 3, 4, False), (64, 128, 8, 3, 2, False), (64, 128, 4, 3, 4),
                                 (32, 128, 8, 3, 4, False), (64, 128, 8, 3, 1, False)]]


def report_candidates(name: str, rows: int, cands: list, copies: list, exact: torch.Tensor, nbytes: int,
                      read: float) -> None:
    """Check each (label, fn(weight)) against `exact` (skipped for labels with "dense"), time it over the cold weight
    copies by graph replay, and print the rows fastest first; a candidate that fails is reported on stderr."""
    res = []
    for label, fn in cands:
        try:
            got = fn(copies[0]).float()
            err = ((got - exact).abs() / (exact.abs() + 1)).max().item() if "dense" not in label else 0.0
            t = time_graph([lambda w=w: fn(w) for w in copies])
        except Exception as exc:  # noqa: BLE001
            print(f"  {name} {rows} {label}: {type(exc).__name__}: {str(exc)[-800:]}", file=sys.stderr)
            continue
        res.append((t, label, err))
    for t, label, err in sorted(res):
        print(f"| {name} | {rows} | {label} | {t * 1e6:.1f} us | {100 * nbytes / t / read:.0f}% BW | err {err:.1e} |",
              flush=True)


def main() -> None:
    dev = torch.device("cuda")
    rows_list = [int(a) for a in sys.argv[1:]] or [1, 8, 16, 32]
    read = read_bandwidth(dev)
    print(f"read bandwidth {read / 1e9:.0f} GB/s")
    for name, (k, n, gated) in SHAPES.items():
        nbytes = k * n // 2 + (k // GROUP) * n * 3
        w4 = [repack_awq(*random_awq(k, n, dev), GROUP) for _ in range(max(2, MIN_BYTES // nbytes))]
        for rows in rows_list:
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
            exact = (w4_gate_up_silu_ref if gated else w4_linear_ref)(x.float(), w4[0]).float()
            cands = []
            if rows == 1:
                cands.append(("gemv default", lambda w: w4_gemv(x, w, gated=gated)))
            if rows <= 32:
                cfgs = NEW if rows <= 16 else NEW32
            else:
                cands.append(("dequant+cuBLAS", lambda w: (w4_gate_up_silu if gated else w4_linear)(x, w)))
                dense = torch.randn(n, k, dtype=torch.bfloat16, device=dev)
                cands.append(("dense bf16 cuBLAS", lambda w: torch.nn.functional.linear(x, dense)))
                cfgs = BIG
            cands += [(f"new {tuple(c)}", lambda w, c=c: w4_mma(x, w, gated=gated, cfg=c)) for c in cfgs]
            report_candidates(name, rows, cands, w4[:6] if rows > 32 else w4, exact, nbytes, read)
        del w4
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
