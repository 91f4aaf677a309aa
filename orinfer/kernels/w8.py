"""orinfer's in-memory 8-bit integer layout ("W8"): GPTQ-Int8 weights repacked at load so that decode reads whole
output rows of codes, as the FP8 kernels read theirs, and the references.

GPTQ's qweight [K / 4, N] int32 holds four consecutive *inputs* of one output column per word, so a kernel that owns
a few output rows would read 4 bytes with a stride of N * 4 bytes. W8 holds, for W [N, K]:

  codes   [N, K] uint8    row n holds output n's codes along K (in the act-order permutation's input order, below)
  scales  [N, G] fp16     one scale per output row and group of `group_size` consecutive inputs (the last may be
                          partial: G = ceil(K / group_size)), the checkpoint's values transposed
  zeros   [N, G] fp16     the zero points, GPTQ's stored value + 1 (1..256: integers, exact in fp16); or one int when
                          they are all equal (symmetric GPTQ: 128), which the kernels then take as a constant

W[n, k] = (codes[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size], formed in fp32 (exact: a 9-bit
integer times an fp16 scale) and rounded once. Bytes per weight: 1 + 2 / group_size with one zero point (1.016 at 128;
4 / group_size with a tensor of them): the FP8 GEMV and MMA kernels read it with their CODES = UINT8 variant
(`kernels/w8_ops.py`).

Act-order (desc_act): GPTQ gives input k the group g_idx[k] in a permuted order. Sorting the inputs by group
(`gptq.gptq_input_order`, `perm`) makes each group a contiguous run: W'[n, i] = W[n, perm[i]], and x W^T = x[:, perm]
W'^T, so the layer gathers x's columns once per call (no weight traffic) and the kernels see plain groups.
Repacking is exact and reversible (`w8_to_gptq`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from orinfer.kernels.activation import silu_and_mul_ref
from orinfer.kernels.fp8_block import fp16_guard
from orinfer.kernels.gptq import (gptq_input_order, pack_gptq_cols, pack_gptq_rows, unpack_gptq_cols,
                                  unpacked_slices)


class W8Weight(NamedTuple):
    codes: torch.Tensor    # [N, K] uint8
    scales: torch.Tensor   # [N, G] fp16
    zeros: torch.Tensor | int   # [N, G] fp16, the zero points (integers 0..256), or the one zero point of all
    group_size: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]


def gptq_to_w8(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               group_size: int) -> tuple[W8Weight, torch.Tensor | None]:
    """(W8 weight of W' [N, K], perm or None) for an 8-bit GPTQ matrix (qweight [K/4, N], qzeros [G, N/4], scales
    [G, N], g_idx [K]), on their device; ValueError when g_idx's groups are not all of `group_size` inputs (the last
    may be short)."""
    k, n = qweight.shape[0] * 4, qweight.shape[1]
    if g_idx.shape != (k,) or scales.shape != (-(-k // group_size), n) or qzeros.shape != (scales.shape[0], n // 4):
        raise ValueError(f"GPTQ tensors do not fit: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}, g_idx {tuple(g_idx.shape)}, group size {group_size}")
    perm = gptq_input_order(g_idx, group_size)
    codes = torch.empty(n, k, dtype=torch.uint8, device=qweight.device)
    for cols, q in unpacked_slices(qweight, 8, perm):
        codes[cols] = q.t()
    zeros = unpack_gptq_cols(qzeros, 8) + 1                # [G, N]: the classic format stores zero - 1
    first = int(zeros[0, 0]) if zeros.numel() else 128
    uniform = bool((zeros == first).all())
    return W8Weight(codes, _row_major(scales.to(torch.float16)),
                    first if uniform else _row_major(zeros.to(torch.float16)), group_size), perm


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """t^T with unit last stride even for one column ([N, 1]: `contiguous()` would keep the transpose's strides)."""
    return t.t().clone(memory_format=torch.contiguous_format)


def w8_to_gptq(w: W8Weight, perm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPTQ checkpoint tensors (qweight, qzeros, scales) a `gptq_to_w8` result came from."""
    q = w.codes.t().to(torch.int32)                        # [K, N] in W8's (permuted) input order
    if perm is not None:
        q = torch.empty_like(q).index_copy_(0, perm, q)
    zeros = (torch.full(w.scales.shape, w.zeros, dtype=torch.int32, device=q.device) if isinstance(w.zeros, int)
             else w.zeros.to(torch.int32))
    return pack_gptq_rows(q, 8), pack_gptq_cols(zeros.t() - 1, 8), w.scales.t().contiguous()


def w8_dequantize_ref(w: W8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] = (q - z) * s in `dtype`, computed in fp32 (fp64 if asked) and rounded once."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    group = torch.arange(w.in_features, device=w.codes.device) // w.group_size
    z = w.zeros if isinstance(w.zeros, int) else w.zeros.to(compute)[:, group]
    s = w.scales.to(compute)[:, group]
    return ((w.codes.to(compute) - z) * s).to(dtype)


def w8_linear_ref(x: torch.Tensor, w: W8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) in x's dtype, W dequantised per call and rounded once to x's dtype (as `gptq_linear_ref`);
    fp16 results clamped to +-65504."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not match in_features {w.in_features}")
    return fp16_guard(F.linear(x, w8_dequantize_ref(w, x.dtype), None if bias is None else bias.to(x.dtype)))


def w8_gate_up_silu_ref(x: torch.Tensor, w: W8Weight) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) for a packed gate_up weight (gate rows first): the linear, then `silu_and_mul_ref`."""
    return silu_and_mul_ref(w8_linear_ref(x, w))
