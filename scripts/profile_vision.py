#!/usr/bin/env python3
"""Where the Qwen3-VL-8B vision tower's time goes on one image (device): the top CUDA kernels of one forward under
torch.profiler, the eager time, and the time when the forward is replayed from a CUDA graph (the launch overhead).

    python3 scripts/profile_vision.py [--image-size 1024x768]
"""

from __future__ import annotations

import argparse

import torch

from orinfer.bench.ceilings import time_cuda
from orinfer.bench.vision_bench import _randomize, vision_flops
from orinfer.config import preset
from orinfer.layers.ops import get_ops
from orinfer.models.qwen3_vl_vision import Qwen3VLVisionTower, VisionConfig


def tower_inputs(image_size: str, dev: torch.device, dtype: torch.dtype
                 ) -> tuple[VisionConfig, tuple[int, int, int], torch.Tensor]:
    """Qwen3-VL-8B's vision config, the patch grid of a WIDTHxHEIGHT image and random patches for it."""
    width, height = (int(v) for v in image_size.lower().split("x"))
    cfg = VisionConfig.from_hf(preset("qwen3-vl-8b").vision_config)
    grid = (1, height // cfg.patch_size, width // cfg.patch_size)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], cfg.patch_dim, device=dev, dtype=dtype)
    return cfg, grid, pixels


def capture_graph(tower: torch.nn.Module, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.cuda.CUDAGraph:
    """One warm-up forward on a side stream, then the forward captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tower(pixels, [grid])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tower(pixels, [grid])
    return graph


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--image-size", default="1024x768")
    args = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg, grid, pixels = tower_inputs(args.image_size, dev, dtype)
    with torch.device(dev):
        tower = Qwen3VLVisionTower(cfg, get_ops("triton", dev), dtype).eval()
    _randomize(tower)
    flops = vision_flops(cfg, grid)
    with torch.inference_mode():
        eager = time_cuda(lambda: tower(pixels, [grid]), warmup=3, iters=10)
        print(f"eager: {eager * 1e3:.2f} ms, {flops / eager / 1e12:.0f} TFLOP/s")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tower(pixels, [grid])
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
        try:
            graph = capture_graph(tower, pixels, grid)
            replay = time_cuda(graph.replay, warmup=3, iters=10)
            print(f"graph replay: {replay * 1e3:.2f} ms, {flops / replay / 1e12:.0f} TFLOP/s")
        except Exception as exc:  # noqa: BLE001 - report why the tower cannot be captured
            print(f"graph capture failed: {type(exc).__name__}: {str(exc)[:300]}")


if __name__ == "__main__":
    main()
