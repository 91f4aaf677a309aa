"""Kernel-bench rows of the FP8 experts at one token (T = 1): the gemv path (`kernels/moe_fp8_decode.py`, what
`fused_moe_fp8` runs for one token with 16-bit x) against the old decode path (`kernels/moe_decode.py` with block_m 1,
the 128-wide FMA loop, in the tiles the GPU's table or the defaults give it), whole and stage by stage, at the routed
experts of Qwen3.5-35B-A3B FP8 and Qwen3-30B-A3B-FP8. In these rows the "triton" row is the gemv path and the "torch"
row the old path (so "speedup" is old us / new us)."""

from __future__ import annotations

from typing import Callable

import torch

from orinfer.kernels.moe_config import MoeConfig

SHAPES = {"Qwen3.5-35B-A3B": (256, 2048, 512, 8), "Qwen3-30B-A3B": (128, 2048, 768, 8)}
BLOCK = (128, 128)


def _fp8_experts(shape: tuple[int, int, int], scale_shape: tuple[int, int, int], dev: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes of `shape` [E, rows, cols] (the kernels' speed does not depend on the values) and block
    scales that keep the products O(1)."""
    from orinfer.kernels.fp8_block import FP8_DTYPE

    q = torch.empty(shape, dtype=FP8_DTYPE, device=dev)
    for e in range(shape[0]):                     # one expert at a time: no fp32 copy of them all
        q[e] = torch.randn(shape[1:], device=dev, dtype=torch.bfloat16).to(FP8_DTYPE)
    return q, torch.full(scale_shape, shape[2] ** -0.5, device=dev)


def moe_fp8_gemv_rows(add: Callable, randn: Callable, esize: int) -> None:
    """Per shape: the whole call, the up stage (gate/up + SwiGLU) and the down stage (+ the split's sum on the old
    path). Bytes: the k chosen experts' e4m3 weights of the stage and their scales, x, h and the output."""
    from orinfer.kernels import moe_decode
    from orinfer.kernels.moe_config import GEMV, default_config, pick_config
    from orinfer.kernels.moe_fp8 import expert_scale_shapes, fp8_config
    from orinfer.kernels.moe_fp8_decode import default_gemv_config, gemv_down, gemv_up
    from orinfer.kernels.moe_ops import fused_moe_fp8, moe_route

    for name, (n_exp, hidden, inter, top_k) in SHAPES.items():
        x = randn(1, hidden)
        dev = x.device
        shapes = expert_scale_shapes(n_exp, hidden, inter, BLOCK)
        (q13, s13), (q2, s2) = (_fp8_experts((n_exp, 2 * inter, hidden), shapes[0], dev),
                                _fp8_experts((n_exp, hidden, inter), shapes[1], dev))
        weights, ids = moe_route(randn(1, n_exp), top_k, True)
        old = pick_config(x, q13, top_k)
        old = fp8_config(default_config(1, n_exp, top_k, False) if old.path == GEMV else old, BLOCK[1])
        new = pick_config(x, q13, top_k)                      # what fused_moe_fp8 runs (`moe_ops._run`)
        new = new if new.path == GEMV else default_gemv_config(top_k, inter)
        h = gemv_up(x, q13, s13, BLOCK, ids, new.up)
        scales = 4 / (BLOCK[0] * BLOCK[1])
        up_bytes = top_k * 2 * inter * hidden * (1 + scales) + (hidden + top_k * inter) * esize
        down_bytes = top_k * hidden * inter * (1 + scales) + (top_k * inter + hidden) * esize
        shape = f"T=1 E={n_exp} H={hidden} I={inter} k={top_k} ({name} FP8)"
        cfgs = f"new {_tiles(new)}; old {_tiles(old)} split={old.split}"
        add("fused_moe_fp8 T=1: gemv path vs old decode path", shape, up_bytes + down_bytes,
            lambda: fused_moe_fp8(x, q13, s13, q2, s2, BLOCK, weights, ids, config=new),
            lambda: fused_moe_fp8(x, q13, s13, q2, s2, BLOCK, weights, ids, config=old),
            flops=2 * top_k * 3 * hidden * inter, config=cfgs)
        add("moe fp8 up (gate/up+SwiGLU) T=1: gemv vs old", shape, up_bytes,
            lambda: gemv_up(x, q13, s13, BLOCK, ids, new.up),
            lambda: moe_decode.decode_up(x, q13, ids, 1, old.up, s13, BLOCK), config=cfgs)
        add("moe fp8 down T=1: gemv vs old (+ split sum)", shape, down_bytes,
            lambda: gemv_down(h, q2, s2, BLOCK, weights, ids, new.down),
            lambda: moe_decode.decode_down(h, q2, weights, ids, 1, old.down, old.split, s2, BLOCK), config=cfgs)
        del q13, s13, q2, s2
        torch.cuda.empty_cache()


def _tiles(cfg: MoeConfig) -> str:
    return f"up={tuple(cfg.up[:3])} down={tuple(cfg.down[:3])}"
