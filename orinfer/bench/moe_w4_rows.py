"""Kernel-bench rows of the 4-bit experts (AWQ / GPTQ-Int4 MoE: `fused_moe_w4`) at Qwen3-30B-A3B's expert shapes,
timed against the 16-bit `fused_moe` on the same routing (the rows' "speedup" is over the 16-bit kernels)."""

from __future__ import annotations

from typing import Callable

import torch

from orinfer.kernels.moe_w4 import W4Experts, w4_config
from orinfer.kernels.w4 import w4_from_codes

GROUP = 128


def random_w4_experts(w: torch.Tensor, group: int = GROUP) -> W4Experts:
    """Random codes and zero points with scales of about w's magnitude, in the W4 layout of w's shape [E, N, K] (the
    values do not matter for timing; the bytes and the layout do)."""
    experts, n, k = w.shape
    gen = torch.Generator(device=w.device).manual_seed(0)
    q = torch.randint(0, 16, (experts * n, k), generator=gen, device=w.device, dtype=torch.int32)
    z = torch.randint(0, 16, (experts * n, k // group), generator=gen, device=w.device, dtype=torch.int32)
    s = torch.full((experts * n, k // group), float(w.float().std()) / 6.5, dtype=torch.float16, device=w.device)
    flat = w4_from_codes(q, z, s, group)
    return W4Experts(flat.packed.view(experts, n, -1), flat.scales.view(experts, n, -1),
                     flat.zeros.view(experts, n, -1), group)


def moe_w4_rows(add: Callable, randn: Callable, w13: torch.Tensor, w2: torch.Tensor, top_k: int, esize: int) -> None:
    """`fused_moe_w4` at decode batches 1, 8, 64 and a 2048-token prefill. Bytes: 0.5 + 3/G per weight of the
    chosen experts, x and the output."""
    from orinfer.kernels.moe_config import default_config
    from orinfer.kernels.moe_ops import fused_moe, fused_moe_w4, moe_route

    n_exp, two_inter, hidden = w13.shape
    inter = two_inter // 2
    q13, q2 = random_w4_experts(w13), random_w4_experts(w2)
    for t in (1, 8, 64, 2048):
        x = randn(t, hidden)
        weights, ids = moe_route(randn(t, n_exp), top_k, True)
        active = ids.unique().numel()
        nbytes = active * 3 * hidden * inter * (0.5 + 3 / GROUP) + 2 * t * hidden * esize + t * top_k * 8
        cfg = w4_config(default_config(t, n_exp, top_k, x.dtype == torch.float32), GROUP, GROUP)
        add("fused_moe_w4 (prefill) vs 16-bit" if t > 64 else "fused_moe_w4 (decode) vs 16-bit",
            f"T={t} E={n_exp} H={hidden} I={inter} k={top_k} G={GROUP} ({active} experts)", nbytes,
            lambda: fused_moe_w4(x, q13, q2, weights, ids),
            lambda: fused_moe(x, w13, w2, weights, ids), flops=2 * t * top_k * 3 * hidden * inter,
            config=f"{cfg.path} bm={cfg.block_m} up={tuple(cfg.up)} down={tuple(cfg.down)} split={cfg.split}")
