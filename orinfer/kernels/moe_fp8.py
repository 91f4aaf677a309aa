"""FP8 block-wise routed experts (Qwen3-30B-A3B-FP8, the Qwen3.5/3.6 MoE FP8 releases): the packed layout, the
reference, and what the Triton expert kernels (`moe_gemm`, `moe_decode` with FP8 on) need from a launch config.

Layout (`layers/fp8_experts.py` fills it at load): w13 float8_e4m3fn [E, 2I, H] (each expert's gate rows, then its up
rows, as the 16-bit experts) with s13 fp32 [E, 2 * ceil(I / bn), ceil(H / bk)], and w2 float8_e4m3fn [E, H, I] with
s2 fp32 [E, ceil(H / bn), ceil(I / bk)]. Gate and up keep their own blocks, as the checkpoint stores them: scale row
r // bn for gate row r, ceil(I / bn) + r // bn for up row I + r (a block never mixes the two, also when I does not
divide by bn; Qwen's real I all do). Each expert's matrix dequantises as a dense FP8 linear does
(`kernels/fp8_block.py`): W[n, k] = q[n, k] * s[row(n), k // bk].

The reference dequantises the experts some token chose (rounded once to x's dtype, as `fp8_block_linear_ref` rounds
a dense weight) and runs `fused_moe_ref`. The kernels read the e4m3 bytes and apply the scales in registers (W8A16:
activations stay 16/32-bit, fp32 accumulation): the grouped GEMMs dequantise each weight tile to x's dtype before
its dot (the reference's weights, up to summation order); the decode path scales each K step's partial sums, which
skips the rounding of W to x's dtype (the fp32 sum of q * s * x).
"""

from __future__ import annotations

import torch

from orinfer.kernels.fp8_block import FP8_DTYPE
from orinfer.kernels.moe import fused_moe_ref
from orinfer.kernels.moe_config import GEMV, MoeConfig, Tile


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expert_scale_rows(rows: int, bn: int, gated: bool) -> torch.Tensor:
    """The scale row of each weight row of one expert's matrix: [2I] for w13 (`gated`, rows = 2I: gate and up each
    start a fresh block row), [H] for w2 (r // bn)."""
    if not gated:
        return torch.arange(rows) // bn
    inter = rows // 2
    half = torch.arange(inter) // bn
    return torch.cat([half, _cdiv(inter, bn) + half])


def expert_scale_shapes(num_experts: int, hidden: int, inter: int, block_size: tuple[int, int]
                        ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of s13 and s2 for E experts of hidden size H and width I in blocks (bn, bk)."""
    bn, bk = block_size
    return ((num_experts, 2 * _cdiv(inter, bn), _cdiv(hidden, bk)),
            (num_experts, _cdiv(hidden, bn), _cdiv(inter, bk)))


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int], gated: bool,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [E, N, K] = q * s of each expert (fp32 product, then cast to dtype); gated: a w13 [E, 2I, K] whose gate
    and up halves keep their own scale rows."""
    experts, n, k = weight.shape
    bn, bk = block_size
    rows = expert_scale_rows(n, bn, gated).to(scale.device)
    cols = (torch.arange(k, device=scale.device) // bk)
    if scale.shape[1:] != (int(rows[-1]) + 1 if n else 0, _cdiv(k, bk)) or scale.shape[0] != experts:
        raise ValueError(f"scales {tuple(scale.shape)} do not fit expert weights {tuple(weight.shape)} in blocks "
                         f"{tuple(block_size)}")
    full = scale.float()[:, rows][:, :, cols]
    return (weight.float() * full).to(dtype)


def fused_moe_fp8_ref(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                      block_size: tuple[int, int], topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe_ref` with FP8 experts (module docstring): x [T, H], w13 e4m3 [E, 2I, H] + s13, w2 e4m3 [E, H, I] +
    s2, topk_weights / topk_ids [T, k] -> [T, H] in x's dtype. Only the chosen experts are dequantised (in x's dtype;
    fp32 for fp32 x), so a call never holds a 16-bit copy of all E experts."""
    used, local = torch.unique(topk_ids.long(), return_inverse=True)
    deq13 = dequantize_experts(w13[used], s13[used], block_size, True, x.dtype)
    deq2 = dequantize_experts(w2[used], s2[used], block_size, False, x.dtype)
    return fused_moe_ref(x, deq13, deq2, topk_weights, local.reshape(topk_ids.shape))


def check_expert_scales(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                        block_size: tuple[int, int]) -> None:
    """ValueError unless the weights are e4m3 and the fp32 scales have the shapes of `expert_scale_shapes`, with a
    unit stride along their last dim (the kernels index them as [E, rows, cols])."""
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 experts must be float8_e4m3fn, got {w13.dtype} and {w2.dtype}")
    experts, two_inter, hidden = w13.shape
    want = expert_scale_shapes(experts, hidden, two_inter // 2, block_size)
    for name, s, shape in (("s13", s13, want[0]), ("s2", s2, want[1])):
        if s.dtype != torch.float32 or tuple(s.shape) != shape or s.stride(2) != 1:
            raise ValueError(f"{name} must be float32 {list(shape)} with unit stride along its last dim (blocks "
                             f"{tuple(block_size)}), got {s.dtype} {list(s.shape)}")


def fp8_config(cfg: MoeConfig, bk: int) -> MoeConfig:
    """A launch config of the 16-bit experts adapted to FP8 weights in blocks of bk inputs: a K step must stay inside
    one scale column, so block_k becomes at most the largest power of two dividing bk; the one-token FMA loop (whose
    [BLOCK_N, BLOCK_K] fp32 register tile sets the bytes a program loads per step) takes proportionally more rows.
    A "gemv" config (`moe_fp8_decode`: its chunks of 16 inputs lie inside a scale column already) stays as it is."""
    def adapt(tile: Tile) -> Tile:
        k = min(tile.block_k, bk & -bk)
        n = tile.block_n * (tile.block_k // k) if cfg.block_m == 1 and cfg.path == "decode" else tile.block_n
        return tile._replace(block_n=n, block_k=k)

    return cfg if cfg.path == GEMV else cfg._replace(up=adapt(cfg.up), down=adapt(cfg.down))
