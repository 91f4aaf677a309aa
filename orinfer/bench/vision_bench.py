"""Vision-encoder benchmark: the Qwen3-VL tower on one synthetic image, against HF transformers' tower, same run.

Random weights of the real shapes (speed depends on shapes only); the input is the patch matrix of one H x W image
([H/16 * W/16, 3*2*16*16]), so preprocessing is not timed (it runs on the CPU before the tower, in both engines).
Reported: encode ms (median of CUDA-event timings after warm-up) as the engine runs it for an image size it has seen
before (a replayed CUDA graph, `models/qwen3_vl_vision_graphs.py`) and for a first image of a size (eager), achieved
TFLOP/s and MFU against the matmul ceiling measured in the same run, and HF's time for the same tower and input
(eager, its default attention, SDPA).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from orinfer.bench.ceilings import time_cuda
from orinfer.models.qwen3_vl_vision import Qwen3VLVisionTower, VisionConfig
from orinfer.models.qwen3_vl_vision_graphs import VisionGraphCache


def vision_flops(cfg: VisionConfig, grid: tuple[int, int, int]) -> float:
    """Matmul flops of one forward: patch embedding, per block qkv/proj/MLP GEMMs and attention (QK^T and PV over
    each frame), the final merger and the DeepStack mergers (norms and activations are negligible)."""
    t, h, w = grid
    n, d, inter = t * h * w, cfg.hidden_size, cfg.intermediate_size
    merged, wide = n // cfg.spatial_merge_size ** 2, d * cfg.spatial_merge_size ** 2
    per_block = 2 * n * (3 * d * d + d * d + 2 * d * inter) + 4 * t * (h * w) ** 2 * d
    mergers = (1 + len(cfg.deepstack_visual_indexes)) * 2 * merged * (wide * wide + wide * cfg.out_hidden_size)
    return 2 * n * cfg.patch_dim * d + cfg.depth * per_block + mergers


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            values = torch.randn(p.shape, generator=gen) * 0.02
            if "norm" in name and name.endswith("weight"):
                values += 1.0
            p.copy_(values)


def bench_vision(cfg: VisionConfig, width: int, height: int, dtype: torch.dtype, device: torch.device, ops: Any,
                 matmul_tflops: float, compare_hf: bool = True) -> dict[str, Any]:
    """Times orinfer's tower (and HF's with compare_hf) on one width x height image; see the module docstring."""
    factor = cfg.patch_size * cfg.spatial_merge_size
    if width % factor or height % factor:
        raise ValueError(f"--image-size sides must be multiples of {factor} (the processor resizes to those)")
    grid = (1, height // cfg.patch_size, width // cfg.patch_size)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], cfg.patch_dim, device=device, dtype=dtype)
    with torch.device(device):
        tower = Qwen3VLVisionTower(cfg, ops, dtype).eval()
    _randomize(tower)
    flops = vision_flops(cfg, grid)
    with torch.inference_mode():
        eager = time_cuda(lambda: tower(pixels, [grid]), warmup=3, iters=10)
        graphs = VisionGraphCache(tower)
        seconds = time_cuda(lambda: graphs(pixels, [grid]), warmup=3, iters=10)  # (warm-up captures the graph)
    out: dict[str, Any] = {"image": f"{width}x{height}", "patches": pixels.shape[0], "gflop": flops / 1e9,
                           "orinfer_ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
                           "mfu_pct": 100 * flops / seconds / 1e12 / matmul_tflops, "eager_ms": eager * 1e3,
                           "eager_mfu_pct": 100 * flops / eager / 1e12 / matmul_tflops}
    del tower, graphs
    if compare_hf:
        out.update(_bench_hf_tower(cfg, pixels, grid, dtype, device, flops))
        out["speedup_vs_hf"] = out["hf_ms"] / out["orinfer_ms"]
    return out


def _bench_hf_tower(cfg: VisionConfig, pixels: torch.Tensor, grid: tuple[int, int, int], dtype: torch.dtype,
                    device: torch.device, flops: float) -> dict[str, float]:
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    fields = dataclasses.asdict(cfg)
    hf_cfg = Qwen3VLVisionConfig(
        depth=cfg.depth, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads, in_channels=cfg.in_channels, patch_size=cfg.patch_size,
        spatial_merge_size=cfg.spatial_merge_size, temporal_patch_size=cfg.temporal_patch_size,
        out_hidden_size=cfg.out_hidden_size, num_position_embeddings=cfg.num_position_embeddings,
        deepstack_visual_indexes=list(fields["deepstack_visual_indexes"]), hidden_act=cfg.hidden_act)
    model = Qwen3VLVisionModel(hf_cfg).to(device=device, dtype=dtype).eval()
    grid_thw = torch.tensor([grid], device=device)
    with torch.inference_mode():
        seconds = time_cuda(lambda: model(pixels, grid_thw=grid_thw), warmup=2, iters=5)
    del model
    torch.cuda.empty_cache()
    return {"hf_ms": seconds * 1e3, "hf_tflops": flops / seconds / 1e12}


def vision_markdown(v: dict[str, Any]) -> list[str]:
    hf = f"{v['hf_ms']:.1f} ms ({v['hf_tflops']:.0f} TFLOP/s)" if "hf_ms" in v else "-"
    rows = [f"| vision encode {v['image']} ({v['patches']} patches, {v['gflop']:.0f} GFLOP), CUDA graph (a size seen "
            f"before) | {v['orinfer_ms']:.1f} ms ({v['tflops']:.0f} TFLOP/s, {v['mfu_pct']:.0f}% MFU) | {hf} |"]
    if "eager_ms" in v:
        rows.append(f"| vision encode, eager (first image of a size) | {v['eager_ms']:.1f} ms "
                    f"({v['eager_mfu_pct']:.0f}% MFU) | - |")
    if "speedup_vs_hf" in v:
        rows.append(f"| vision encode speed-up vs HF | {v['speedup_vs_hf']:.1f}x | - |")
    return rows
