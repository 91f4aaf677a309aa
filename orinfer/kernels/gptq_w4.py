"""GPTQ 4-bit weights repacked into orinfer's W4 layout (kernels/w4.py), so that the AWQ Triton kernels serve them.

W4 wants each group to be a contiguous run of G inputs; GPTQ's act-order (desc_act) gives input k the group g_idx[k]
in a permuted order. Sorting the inputs by group (a stable argsort of g_idx, `perm`) makes the runs contiguous:
W'[n, i] = W[n, perm[i]] has group i // G, and x W^T = x[:, perm] W'^T. So the layer permutes x's columns once per
call (one gather of the activations, no weight traffic) and reads W' through the W4 kernels. Zero points are
GPTQ's stored zero + 1 (8 for symmetric 4-bit), scales are the checkpoint's, transposed. Exact: W4's
(q - z) * s equals GPTQ's dequantisation element for element.
"""

from __future__ import annotations

import torch

from orinfer.kernels.gptq import (gptq_input_order, pack_gptq_cols, pack_gptq_rows, unpack_gptq_cols,
                                 unpacked_slices)
from orinfer.kernels.w4 import W4Weight, check_group_size, w4_from_codes, w4_unpack


def gptq_to_w4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               group_size: int) -> tuple[W4Weight, torch.Tensor | None]:
    """(W4 weight of W' [N, K], perm or None) for a 4-bit GPTQ matrix; ValueError when W4 cannot hold it (group size
    not dividing K or not one W4 supports, zero points above 15). Repacked a slice of columns at a time
    (`gptq.unpacked_slices`)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    g = check_group_size(k, group_size)
    zeros = unpack_gptq_cols(qzeros, 4)[:, :n] + 1        # [G, N]: the classic format stores zero - 1
    if int(zeros.max()) > 15:
        raise ValueError("a zero point of 16 (stored 15) does not fit W4's 4-bit zeros")
    perm = gptq_input_order(g_idx, g)
    parts = [w4_from_codes(q.t(), zeros[:, cols].t(), scales[:, cols].t(), g)
             for cols, q in unpacked_slices(qweight, 4, perm)]
    return W4Weight(torch.cat([w.packed for w in parts]), torch.cat([w.scales for w in parts]),
                    torch.cat([w.zeros for w in parts]), g), perm


def w4_to_gptq(w: W4Weight, perm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPTQ checkpoint tensors (qweight, qzeros, scales) a `gptq_to_w4` result came from."""
    q = w4_unpack(w.packed, w.group_size).t()             # [K, N] in W4's (permuted) input order
    if perm is not None:
        q = torch.empty_like(q).index_copy_(0, perm, q)
    return (pack_gptq_rows(q, 4), pack_gptq_cols(w.zeros.t().to(torch.int32) - 1, 4),
            w.scales.t().contiguous())
