"""4-bit routed experts (AWQ, GPTQ-Int4 MoE checkpoints): the packed layout, the reference, and what the Triton W4
expert kernels (`moe_w4_gemm.py`) need from a launch config.

Layout (`layers/w4_experts.py` fills it at load): every expert's matrix in orinfer's W4 layout (`kernels/w4.py`), the
experts stacked along a leading dimension:

    w13  packed [E, 2I, H/8] int32, scales [E, 2I, H/G] fp16, zeros [E, 2I, H/G] uint8   (gate rows, then up rows)
    w2   packed [E, H, I/8]  int32, scales [E, H, I/G]  fp16, zeros [E, H, I/G]  uint8

Row n of an expert holds output n's weights along K in W4's chunk order (a chunk is 8R consecutive inputs, R =
min(G, 128) / 8 int32: nibble p of the chunk's int32 r is input p*R + r), so each expert dequantises as a dense W4
linear does: W[e, n, k] = (q[e, n, k] - z[e, n, k // G]) * s[e, n, k // G]. Because rows are outputs, gate|up packing
is a plain concatenation of rows (unlike AWQ's [K, N/8], where 8 output columns share a word). AWQ and GPTQ both
repack into this exactly (`kernels/w4.repack_awq`, `kernels/gptq_w4.gptq_to_w4`); 0.5 + 3/G bytes per weight.

The reference dequantises the experts some token chose (exact in fp32, rounded once to x's dtype, as the FP8
reference rounds its weights) and runs `fused_moe_ref`. The kernels read the int4 words and unpack them in registers:
the grouped GEMMs dequantise each weight tile to x's dtype before its dot (the reference's weights, up to summation
order); the decode path multiplies the exact codes q - z and applies each row's scale to the chunk's partial sums
(no rounding of W to x's dtype: the fp32 sum of (q - z) * s * x up to order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from orinfer.kernels.moe import fused_moe_ref
from orinfer.kernels.moe_config import MoeConfig, Tile
from orinfer.kernels.w4 import W4Weight, chunk_int32, w4_dequantize_ref


class W4Experts(NamedTuple):
    """One expert matrix per expert, in the W4 layout: packed [E, N, K/8] int32, scales [E, N, K/G], zeros [E, N, K/G]
    uint8 (N: 2I for w13, H for w2)."""
    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def out_features(self) -> int:
        return self.packed.shape[1]

    @property
    def in_features(self) -> int:
        return self.packed.shape[2] * 8

    def expert(self, e: int) -> W4Weight:
        """Expert e's matrix as a dense W4 weight (views)."""
        return W4Weight(self.packed[e], self.scales[e], self.zeros[e], self.group_size)

    def select(self, experts: torch.Tensor) -> "W4Experts":
        """The experts listed in `experts` (a copy), in that order."""
        return W4Experts(self.packed[experts], self.scales[experts], self.zeros[experts], self.group_size)


def dequantize_w4_experts(w: W4Experts, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [E, N, K] = (q - z) * s of every expert of `w` (fp32 products, then cast to dtype)."""
    experts, n, k8 = w.packed.shape
    flat = W4Weight(w.packed.reshape(experts * n, k8), w.scales.reshape(experts * n, -1),
                    w.zeros.reshape(experts * n, -1), w.group_size)
    return w4_dequantize_ref(flat, dtype).reshape(experts, n, k8 * 8)


def fused_moe_w4_ref(x: torch.Tensor, w13: W4Experts, w2: W4Experts, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe_ref` with 4-bit experts (module docstring): x [T, H], w13 of [E, 2I, H], w2 of [E, H, I],
    topk_weights / topk_ids [T, k] -> [T, H] in x's dtype. Only the chosen experts are dequantised (in x's dtype;
    fp32 for fp32 x), so a call never holds a 16-bit copy of all E experts."""
    used, local = torch.unique(topk_ids.long(), return_inverse=True)
    deq13 = dequantize_w4_experts(w13.select(used), x.dtype)
    deq2 = dequantize_w4_experts(w2.select(used), x.dtype)
    return fused_moe_ref(x, deq13, deq2, topk_weights, local.reshape(topk_ids.shape))


def check_w4_experts(x: torch.Tensor, w13: W4Experts, w2: W4Experts) -> None:
    """ValueError unless w13 / w2 are W4 experts of matching shapes for x [T, H]: int32 words, uint8 zeros, scales
    and zeros of one shape, contiguous, group sizes the W4 layout holds."""
    if x.dim() != 2:
        raise ValueError(f"fused_moe_w4 takes x [T, H], got {tuple(x.shape)}")
    for name, w, n, k in (("w13", w13, None, x.shape[1]), ("w2", w2, x.shape[1], None)):
        experts, rows, k8 = w.packed.shape if w.packed.dim() == 3 else (0, 0, 0)
        groups = (k8 * 8) // w.group_size if w.group_size > 0 else 0
        ok = (w.packed.dim() == 3 and w.packed.dtype == torch.int32 and w.zeros.dtype == torch.uint8
              and w.scales.is_floating_point() and tuple(w.scales.shape) == (experts, rows, groups)
              and tuple(w.zeros.shape) == (experts, rows, groups) and groups * w.group_size == k8 * 8
              and (w.group_size % 128 == 0 or w.group_size in (16, 32, 64))
              and all(t.is_contiguous() for t in (w.packed, w.scales, w.zeros))
              and (n is None or rows == n) and (k is None or k8 * 8 == k))
        if not ok:
            raise ValueError(f"{name}: expected W4 experts (packed int32 [E, N, K/8], scales and uint8 zeros "
                             f"[E, N, K/G], contiguous) for x {tuple(x.shape)}, got {tuple(w.packed.shape)} "
                             f"{w.packed.dtype}, {tuple(w.scales.shape)} {w.scales.dtype}, {tuple(w.zeros.shape)} "
                             f"{w.zeros.dtype}, group {w.group_size}")
    if (w13.num_experts != w2.num_experts or w13.out_features != 2 * w2.in_features):
        raise ValueError(f"w13 {tuple(w13.packed.shape)} and w2 {tuple(w2.packed.shape)} are not one set of experts")


# The most weights a program unpacks per K step (both of a gated pair each): the unpacked [BLOCK_N, 8R] tile lives in
# registers between the load and the dot, beside the accumulators; past these the sm_90 builds spill
# (tests/test_moe_w4_codegen.py).
UNPACKED_LIMIT = {"grouped": 8192, "decode": 4096}


def w4_config(cfg: MoeConfig, up_group: int, down_group: int) -> MoeConfig:
    """A launch config of the 16-bit experts adapted to W4 weights (w13 in groups of up_group inputs, w2 of
    down_group): a K step is one chunk of 8R inputs (inside one group: one zero point and scale per weight row); the
    one-token FMA loop takes as many more rows as keep its weights per step (its [BLOCK_N, BLOCK_K] fp32 tile); every
    path keeps BLOCK_N * 8R within UNPACKED_LIMIT."""
    def adapt(tile: Tile, group: int) -> Tile:
        chunk = 8 * chunk_int32(group)
        n = tile.block_n
        if cfg.block_m == 1 and cfg.path == "decode":
            n = max(1, tile.block_n * tile.block_k // chunk)
        n = min(n, max(16, UNPACKED_LIMIT[cfg.path] // chunk))
        return tile._replace(block_n=n, block_k=chunk)

    return cfg._replace(up=adapt(cfg.up, up_group), down=adapt(cfg.down, down_group))
