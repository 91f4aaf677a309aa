"""orinfer's in-memory INT4 layout ("W4"): AWQ weights repacked at load so that decode streams long runs along K.

AWQ checkpoints store qweight [K, N/8]: one int32 holds eight *output columns* of one input row, so a GEMV that owns a
few output columns reads 4-16 bytes per row with a stride of N/2 bytes, and must split K across programs (partial
sums, a second kernel) to fill the GPU. The dense bf16 GEMV that reaches 84-98% of the read bandwidth does the
opposite: each program owns a few output rows and reads whole rows of W [N, K]. W4 gives the INT4 kernels that shape:

  packed  [N, K/8] int32   row n holds output n's weights along K. Within a chunk of 8R consecutive inputs
                           (R = min(G, 128) / 8 int32), nibble p (bits 4p..4p+3) of the chunk's int32 r holds
                           k = chunk * 8R + p * R + r. So the eight nibbles of a tile of R int32 are eight contiguous
                           runs of R inputs: a kernel multiplies nibble p by x[chunk*8R + p*R : ... + R] (a contiguous
                           load) and a tensor-core kernel unpacks [BN, R] int32 to a [BN, 8R] tile in k order.
  scales  [N, K/G] fp16    one scale per output row and group (the checkpoint's values, transposed)
  zeros   [N, K/G] uint8   the group's zero point 0..15, unpacked (1 byte instead of 4 bits: +0.4% of the bytes)

W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]. Bytes per weight: 0.5 + 3/G (0.523 at G = 128, as AWQ's 0.52).
The group size must be a multiple of 128 or a power of two from 16 to 64 (a chunk never straddles two groups).
Repacking is exact and reversible (`w4_to_awq` gives the checkpoint tensors back).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from orinfer.kernels.awq import AWQ_PACK_ORDER, FP16_MAX, awq_shapes, awq_unpack


class W4Weight(NamedTuple):
    packed: torch.Tensor   # [N, K/8] int32
    scales: torch.Tensor   # [N, K/G] fp16 (or the checkpoint's scale dtype)
    zeros: torch.Tensor    # [N, K/G] uint8
    group_size: int

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 8

    @property
    def chunk_int32(self) -> int:
        return chunk_int32(self.group_size)


def chunk_int32(group_size: int) -> int:
    """R: int32 per chunk of 8R inputs (a chunk lies in one group; 16 int32 = 128 inputs at most)."""
    return min(group_size, 128) // 8


def check_group_size(in_features: int, group_size: int) -> int:
    """The effective group size (-1 = whole rows) after checking that the W4 layout can hold it; ValueError if not."""
    g = in_features if group_size == -1 else int(group_size)
    if g <= 0 or in_features % g:
        raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
    if not (g % 128 == 0 or g in (16, 32, 64)):
        raise ValueError(f"group_size {g} is not supported (a multiple of 128, or 16, 32, 64)")
    return g


def _pack_rows(q: torch.Tensor, r: int) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K/8] int32 in the W4 chunk order."""
    n, k = q.shape
    chunks = q.to(torch.int64).reshape(n, k // (8 * r), 8, r)
    words = torch.zeros(n, k // (8 * r), r, dtype=torch.int64, device=q.device)
    for p in range(8):
        words |= chunks[:, :, p, :] << (4 * p)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # two's complement: nibble 7 holds the sign bit
    return words.to(torch.int32).reshape(n, k // 8)


def w4_unpack(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K/8] int32 -> [N, K] int32 codes 0..15 in k order (undoes the chunk order)."""
    r = chunk_int32(group_size)
    n, k8 = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.reshape(n, k8 // r, 1, r) >> shifts[None, None, :, None]) & 0xF  # [N, chunks, 8, R]
    return nibbles.reshape(n, k8 * 8)


def repack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> W4Weight:
    """AWQ checkpoint tensors (qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]) -> W4, on their device."""
    k, _, g = awq_shapes(qweight, qzeros, scales, group_size)
    return w4_from_codes(awq_unpack(qweight).t(), awq_unpack(qzeros).t(), scales.t(), g)


def w4_from_codes(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> W4Weight:
    """W4 from unpacked codes: q [N, K] and zeros [N, K/G] in 0..15, scales [N, K/G] (any 4-bit format whose groups
    are contiguous runs of inputs: AWQ, GPTQ after its act-order permutation)."""
    g = check_group_size(q.shape[1], group_size)
    packed = _pack_rows(q, chunk_int32(g)).contiguous()
    return W4Weight(packed, scales.contiguous(), zeros.to(torch.uint8).contiguous(), g)


def _awq_pack_columns(q: torch.Tensor) -> torch.Tensor:
    """[R, C] codes -> [R, C/8] int32 in AWQ's interleaved column order."""
    rows, cols = q.shape
    q = q.to(torch.int64).reshape(rows, cols // 8, 8)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64, device=q.device)
    for p, col in enumerate(AWQ_PACK_ORDER):
        words |= q[:, :, col] << (4 * p)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def w4_to_awq(w: W4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The AWQ checkpoint tensors (qweight, qzeros, scales) a W4 weight came from."""
    q = w4_unpack(w.packed, w.group_size).t()
    return (_awq_pack_columns(q).contiguous(), _awq_pack_columns(w.zeros.t().to(torch.int32)).contiguous(),
            w.scales.t().contiguous())


def w4_dequantize_ref(w: W4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """W [N, K] = (q - z) * s in `dtype` (default: the scales' dtype), computed in fp32 (fp64 if asked)."""
    out_dtype = dtype or w.scales.dtype
    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    q = w4_unpack(w.packed, w.group_size).to(compute)
    z = w.zeros.to(compute).repeat_interleave(w.group_size, dim=1)
    s = w.scales.to(compute).repeat_interleave(w.group_size, dim=1)
    return ((q - z) * s).to(out_dtype)


def clamp_cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rounds fp32 results to `dtype`; fp16 is clamped to +-65504 first (Qwen3 activations can leave its range)."""
    if dtype == torch.float16:
        y = y.clamp(-FP16_MAX, FP16_MAX)
    return y.to(dtype)


def w4_linear_ref(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b): dequantise, multiply in fp32 (fp64 for fp64 x), round once to x's dtype (fp16: clamped)."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not match in_features {w.in_features}")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.reshape(-1, w.in_features).to(compute) @ w4_dequantize_ref(w, compute).t()
    if bias is not None:
        y = y + bias.to(compute)
    return clamp_cast(y, x.dtype).reshape(*x.shape[:-1], w.out_features)


def w4_gate_up_silu_ref(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """silu(g) * u for a packed gate_up weight (gate rows first), rounding as GEMM + `silu_and_mul_ref` does."""
    gu = w4_linear_ref(x, w)
    inter = gu.shape[-1] // 2
    g, u = gu[..., :inter], gu[..., inter:]
    if x.dtype in (torch.float16, torch.bfloat16):
        return clamp_cast(F.silu(g).float() * u.float(), x.dtype)
    return F.silu(g) * u
