"""Batch-1 lm_head GEMV (Qwen3-8B: [151936, 4096] bf16, `ops.linear` of the triton backend) in graph replay over
two cold copies, against the read ceiling of the same process. Usage (device): python3 scripts/lm_head_time.py"""

from __future__ import annotations

import torch

from gemv_sweep import time_graph  # same folder
from orinfer.bench.ceilings import read_bandwidth
from orinfer.layers.triton_ops import triton_linear


def main() -> None:
    dev = torch.device("cuda")
    read = read_bandwidth(dev)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
    heads = [torch.randn(151936, 4096, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(2)]
    t = time_graph([lambda w=w: triton_linear(x, w) for w in heads])
    ideal = heads[0].numel() * 2 / read
    print(f"lm_head b1: {t * 1e6:.1f} us, ideal at {read / 1e9:.0f} GB/s {ideal * 1e6:.1f} us "
          f"({100 * ideal / t:.0f}%)")


if __name__ == "__main__":
    main()
