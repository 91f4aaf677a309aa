"""GPTQ weights (classic checkpoint format, symmetric, 4 or 8 bits): unpacking, dequantization and the linear, pure
torch (the references). The format is described in orinfer/gptq_config.py:

    W[n, k] = (q[k, n] - (z[g_idx[k], n] + 1)) * scales[g_idx[k], n]

with q unpacked from qweight [K / P, N] along the input dimension and z from qzeros [groups, N / P] along the
output dimension, P = 32 / bits values per int32, value i of a word in bits [bits * i, bits * (i + 1)).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from orinfer.kernels.fp8_block import fp16_guard


# Weights repacked at a time (`gptq_w4.gptq_to_w4`, `w8.gptq_to_w8`: whole output columns, `unpacked_slices`): a
# slice's codes pass through int32 and int64 tensors, so repacking a whole Qwen3-8B gate_up (100M weights) at once
# held ~1.5 GB of transients beside the model (peak 7.2 GiB against AWQ's 6.1 for the same 5.7 GiB of weights, NOTES
# run 429). 4096-column slices (run 434: 6.5 GiB) left down's 12288-input matrix whole. With 8M weights a slice the
# 4-bit repack's peak rises 0.13-0.36 GB over its inputs at Qwen3-8B's shapes, against 0.51-1.46 GB whole (measured
# on the CPU, NOTES run 438).
REPACK_WEIGHTS = 1 << 23


def unpacked_slices(qweight: torch.Tensor, bits: int, perm: torch.Tensor | None
                    ) -> Iterator[tuple[slice, torch.Tensor]]:
    """(output columns, their codes q [K, cols] int32 with the inputs in perm's order) for a qweight [K / P, N], about
    REPACK_WEIGHTS weights at a time (whole columns, at least one), for the repacks."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    step = max(1, REPACK_WEIGHTS // max(k, 1))
    for lo in range(0, n, step):
        cols = slice(lo, min(lo + step, n))
        q = unpack_gptq_rows(qweight[:, cols], bits)
        yield cols, (q if perm is None else q[perm])


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_gptq_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """q [K, N] int32 (0 .. 2^bits - 1) from qweight [K / P, N]: row r's word holds inputs P r .. P r + P - 1."""
    words, n = qweight.shape
    vals = (qweight.unsqueeze(1) >> _shifts(bits, qweight.device).view(1, -1, 1)) & ((1 << bits) - 1)
    return vals.reshape(words * (32 // bits), n)


def unpack_gptq_cols(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """z [G, N] int32 from qzeros [G, N / P]: column c's word holds outputs P c .. P c + P - 1."""
    g, words = qzeros.shape
    vals = (qzeros.unsqueeze(2) >> _shifts(bits, qzeros.device).view(1, 1, -1)) & ((1 << bits) - 1)
    return vals.reshape(g, words * (32 // bits))


def gptq_dequantize_ref(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                        bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] in `dtype`: (q - z - 1) * s, exact in fp32 (a small integer times an fp16 scale), then rounded once.
    qweight [K/P, N] int32, qzeros [G, N/P] int32, scales [G, N] fp16, g_idx [K] int (values in 0 .. G-1)."""
    q = unpack_gptq_rows(qweight, bits)
    k, n = q.shape
    if g_idx.shape != (k,) or scales.shape[1] != n or qzeros.shape[0] != scales.shape[0]:
        raise ValueError(f"GPTQ tensors do not fit: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}, g_idx {tuple(g_idx.shape)} ({bits} bits)")
    z = unpack_gptq_cols(qzeros, bits)[:, :n] + 1
    groups = g_idx.long()
    w_t = (q - z[groups]).float() * scales.float()[groups]
    return w_t.t().to(dtype)


def gptq_linear_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, bits: int, shards: tuple[tuple[int, int], ...] | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) in x's dtype, W dequantised per call. A packed layer (q|k|v, gate|up) passes `shards`, the
    (first column, columns) of each checkpoint matrix, and g_idx [S, K] (each matrix has its own, which act-order
    may make different); otherwise g_idx is [K]. fp16 results are clamped to +-65504 (`fp16_guard`)."""
    if shards is None:
        w = gptq_dequantize_ref(qweight, qzeros, scales, g_idx, bits, x.dtype)
    else:
        p = 32 // bits
        w = torch.cat([gptq_dequantize_ref(qweight[:, c0:c0 + cols], qzeros[:, c0 // p:(c0 + cols) // p],
                                           scales[:, c0:c0 + cols], g_idx[i], bits, x.dtype)
                       for i, (c0, cols) in enumerate(shards)])
    return fp16_guard(F.linear(x, w, None if bias is None else bias.to(x.dtype)))


def gptq_input_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input permutation that makes g_idx's groups contiguous runs of `group_size`: None when g_idx already is
    k // G; ValueError when no permutation does (groups of other sizes)."""
    k = g_idx.shape[0]
    plain = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx.long(), plain):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], plain):
        raise ValueError("g_idx does not hold groups of group_size inputs each")
    return perm


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement into int32


def pack_gptq_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [K, N] codes -> qweight [K / P, N] int32 (inverse of `unpack_gptq_rows`)."""
    per_word = 32 // bits
    v = q.to(torch.int64).reshape(q.shape[0] // per_word, per_word, q.shape[1])
    words = torch.zeros(v.shape[0], v.shape[2], dtype=torch.int64, device=q.device)
    for i in range(per_word):
        words |= v[:, i, :] << (bits * i)
    return _to_int32(words)


def pack_gptq_cols(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z [G, N] codes -> qzeros [G, N / P] int32 (inverse of `unpack_gptq_cols`)."""
    return pack_gptq_rows(z.t(), bits).t().contiguous()
