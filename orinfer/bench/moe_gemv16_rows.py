"""Kernel-bench rows of the 16-bit experts at one token (T = 1): the gemv path (`kernels/moe_gemv16.py`, one-row GEMVs
in 16-byte chunks; what `fused_moe` runs where its table's T = 1 entry is a "gemv" config) against the decode path
(`kernels/moe_decode.py` with block_m 1, the 128-wide FMA loop, in the tiles the GPU's table or the defaults give
it), whole and stage by stage, at the routed experts of Qwen3-30B-A3B. The "triton" row is the gemv path and the
"torch" row the decode path (so "speedup" is decode us / gemv us). The experts take the bench's dtype (bf16 or fp16;
an fp32 bench has no such rows: the gemv path is for 16-bit experts)."""

from __future__ import annotations

from typing import Callable

import torch

SHAPES = {"Qwen3-30B-A3B": (128, 2048, 768, 8)}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def moe_gemv16_rows(add: Callable, randn: Callable, esize: int) -> None:
    """Per shape: the whole call, the up stage (gate/up + SwiGLU) and the down stage (+ the split's sum on the decode
    path). Bytes: the k chosen experts' weights of the stage, x, h and the output."""
    from orinfer.bench.moe_fp8_gemv_rows import _tiles
    from orinfer.kernels import moe_decode
    from orinfer.kernels.moe_config import GEMV, default_config, pick_config
    from orinfer.kernels.moe_fp8_decode import gemv_down, gemv_up
    from orinfer.kernels.moe_gemv16 import default_gemv16_config
    from orinfer.kernels.moe_ops import fused_moe, moe_route

    for name, (n_exp, hidden, inter, top_k) in SHAPES.items():
        x = randn(1, hidden)
        if x.dtype not in _NAMES:
            return
        w13 = randn(n_exp, 2 * inter, hidden, scale=hidden ** -0.5)
        w2 = randn(n_exp, hidden, inter, scale=inter ** -0.5)
        weights, ids = moe_route(randn(1, n_exp), top_k, True)
        table = pick_config(x, w13, top_k)                    # what fused_moe runs (`moe_ops._run`)
        new = table if table.path == GEMV else default_gemv16_config(top_k, inter)
        old = table if table.path == "decode" else default_config(1, n_exp, top_k, False)
        h = gemv_up(x, w13, None, None, ids, new.up)
        up_bytes = (top_k * 2 * inter * hidden + hidden + top_k * inter) * esize
        down_bytes = (top_k * hidden * inter + top_k * inter + hidden) * esize
        label = _NAMES[x.dtype]
        shape = f"T=1 E={n_exp} H={hidden} I={inter} k={top_k} ({name} {label})"
        cfgs = f"new {_tiles(new)}; old {_tiles(old)} split={old.split}"
        add(f"fused_moe {label} T=1: gemv path vs decode path", shape, up_bytes + down_bytes,
            lambda: fused_moe(x, w13, w2, weights, ids, config=new),
            lambda: fused_moe(x, w13, w2, weights, ids, config=old),
            flops=2 * top_k * 3 * hidden * inter, config=cfgs)
        add(f"moe {label} up (gate/up+SwiGLU) T=1: gemv vs decode", shape, up_bytes,
            lambda: gemv_up(x, w13, None, None, ids, new.up),
            lambda: moe_decode.decode_up(x, w13, ids, 1, old.up), config=cfgs)
        add(f"moe {label} down T=1: gemv vs decode (+ split sum)", shape, down_bytes,
            lambda: gemv_down(h, w2, None, None, weights, ids, new.down),
            lambda: moe_decode.decode_down(h, w2, weights, ids, 1, old.down, old.split), config=cfgs)
        del w13, w2
        torch.cuda.empty_cache()
