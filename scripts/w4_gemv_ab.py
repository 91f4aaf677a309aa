"""One-row W4 GEMV configs (orinfer.kernels.w4_gemv) on the four Qwen3-8B projections, timed the way decode runs them
(graph replay over cold weight copies, each result checked against the fp32 reference first); with
scripts/ab_head_w4_gemv.py present (a copy of the previous commit's module) its default config is timed in the same
process. Usage (device): python3 scripts/w4_gemv_ab.py [BLOCK_N,BLOCK_KP,WARPS ...]."""
from __future__ import annotations

import importlib
import sys

import torch

from orinfer.bench.ceilings import read_bandwidth
from orinfer.kernels.w4 import repack_awq, w4_gate_up_silu_ref, w4_linear_ref
from orinfer.kernels.w4_gemv import DEFAULT_GEMV, W4GemvConfig, w4_gemv
from w4_ab import report_candidates
from w4_sweep import GROUP, MIN_BYTES, SHAPES, random_awq

CONFIGS = [W4GemvConfig(*c) for c in [(4, 512, 4), (8, 512, 4), (16, 512, 4), (2, 512, 4), (4, 1024, 4)]]


def main() -> None:
    dev = torch.device("cuda")
    cfgs = [W4GemvConfig(*map(int, a.split(","))) for a in sys.argv[1:]] or CONFIGS
    read = read_bandwidth(dev)
    print(f"read bandwidth {read / 1e9:.0f} GB/s")
    try:
        head = importlib.import_module("ab_head_w4_gemv")
    except ImportError:
        head = None

    for name, (k, n, gated) in SHAPES.items():
        nbytes = k * n // 2 + (k // GROUP) * n * 3
        w4 = [repack_awq(*random_awq(k, n, dev), GROUP) for _ in range(max(2, MIN_BYTES // nbytes))]
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        exact = (w4_gate_up_silu_ref if gated else w4_linear_ref)(x.float(), w4[0]).float()
        cands = [(f"new {tuple(c)}", lambda w, c=c: w4_gemv(x, w, gated=gated, cfg=c)) for c in cfgs]
        if head is not None:
            cands.append((f"head {tuple(DEFAULT_GEMV)}", lambda w: head.w4_gemv(x, w, gated=gated)))
        report_candidates(name, 1, cands, w4, exact, nbytes, read)
        del w4
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
