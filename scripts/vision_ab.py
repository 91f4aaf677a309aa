#!/usr/bin/env python3
"""A/B of op-table variants for the Qwen3-VL-8B vision tower (device): one tower, one CUDA graph per variant, graph
replays timed in alternation (rounds x variants), so machine drift hits every variant alike.

    PYTHONPATH=.:scripts python3 scripts/vision_ab.py [--rounds 5] [--image-size 1024x768]

Variants: "table" (the triton op table as it is) and "fc1 unfused" (fc1 as the GEMM then `bias_gelu`).
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from orinfer.bench.ceilings import time_cuda
from orinfer.bench.vision_bench import _randomize, vision_flops
from orinfer.kernels.vision import bias_gelu
from orinfer.layers.ops import get_ops
from orinfer.layers.triton_ops import triton_linear
from orinfer.models.qwen3_vl_vision import Qwen3VLVisionTower
from profile_vision import capture_graph, tower_inputs


def _set_ops(tower: torch.nn.Module, ops: object) -> None:
    for module in tower.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--image-size", default="1024x768")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg, grid, pixels = tower_inputs(args.image_size, dev, dtype)
    table = get_ops("triton", dev)
    variants = {
        "table": table,
        "fc1 unfused": dataclasses.replace(
            table, linear_bias_gelu=lambda x, w, b, a="tanh": bias_gelu(triton_linear(x, w), b, a)),
    }
    with torch.device(dev):
        tower = Qwen3VLVisionTower(cfg, table, dtype).eval()
    _randomize(tower)
    flops = vision_flops(cfg, grid)
    graphs = {}
    with torch.inference_mode():
        for name, ops in variants.items():
            _set_ops(tower, ops)
            graphs[name] = capture_graph(tower, pixels, grid)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, graph in graphs.items():
                times[name].append(time_cuda(graph.replay, warmup=2, iters=20))
    for name, ts in times.items():
        best, median = min(ts), sorted(ts)[len(ts) // 2]
        print(f"{name}: graph replay median {median * 1e3:.2f} ms (best {best * 1e3:.2f}), "
              f"{flops / median / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
