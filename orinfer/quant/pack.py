"""AWQ's int32 packing of 4-bit values ("gemm" layout), and its inverse.

Eight values per int32 along the last (output) dimension, interleaved: for columns 8j..8j+7, nibble p (bits
4p..4p+3) holds column 8j + AWQ_PACK_ORDER[p] with AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7), i.e. the low 16 bits
hold the even columns and the high 16 bits the odd ones. Unpacking reads column 8j + c from nibble
AWQ_UNPACK_ORDER[c] = (0, 4, 1, 5, 2, 6, 3, 7) (the seed's "awq_order").
"""

from __future__ import annotations

import torch

from orinfer.kernels.awq import AWQ_PACK_ORDER, AWQ_UNPACK_ORDER, awq_unpack

__all__ = ["AWQ_PACK_ORDER", "AWQ_UNPACK_ORDER", "pack_int4", "unpack_int4"]


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, C] integers in 0..15 (C a multiple of 8) -> [R, C/8] int32 in AWQ's interleaved order."""
    if values.dim() != 2 or values.shape[1] % 8:
        raise ValueError(f"pack_int4 needs a 2-D tensor with a multiple of 8 columns, got {tuple(values.shape)}")
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) > 15):
        raise ValueError("pack_int4: values must lie in 0..15")
    v = v.reshape(v.shape[0], -1, 8)
    packed = torch.zeros(v.shape[:2], dtype=torch.int64, device=v.device)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        packed |= v[..., column] << (4 * nibble)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed)  # two's complement into int32's range
    return packed.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/8] int32 -> [R, C] int32 values 0..15 in column order (inverse of `pack_int4`)."""
    return awq_unpack(packed)
