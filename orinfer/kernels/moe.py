"""Mixture-of-experts references: routing and the expert FFN, the contract the Triton MoE kernels implement.

A sparse MoE block (Qwen3-MoE, the Qwen3.5-family MoE, Qwen3-VL-MoE) sends each token to `top_k` of `E` experts:

    probs = softmax(router_logits) in fp32                      [T, E]
    weights, ids = top_k(probs)                                 [T, k] each
    weights /= weights.sum(-1)              (norm_topk_prob: renormalised over the chosen k)
    out[t] = sum_j weights[t, j] * FFN_{ids[t, j]}(x[t])
    FFN_e(x) = (silu(x Wg_e^T) * (x Wu_e^T)) Wd_e^T

Expert weights are packed at load into two tensors: `w13` [E, 2I, H] (gate rows 0..I-1, then up rows I..2I-1, as HF
transformers' `gate_up_proj`) and `w2` [E, H, I] (`down_proj`). A shared expert, when the model has one, is an ordinary
MLP outside these ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype) -> (weights [T, top_k] fp32, expert ids [T, top_k] int32).

    Softmax over all experts in fp32, the top_k largest (ties: the lower expert id, as torch.topk), divided by their
    sum when `renormalize`. The weights stay fp32; the expert op rounds them where it multiplies."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] fp32, topk_ids [T, k] int -> [T, H] in x's dtype.

    Each (token, expert) pair: h = silu(x Wg^T) * (x Wu^T) rounded to x's dtype (as HF's expert MLP rounds after each
    op), y = h Wd^T in x's dtype; the token's k outputs times their weights are summed in fp32 and rounded once.
    Experts that no token chose are never read. In mixed mode (fp32 x, 16-bit weights) the weights are widened."""
    tokens, hidden = x.shape
    inter = w2.shape[2]
    if w13.dtype != x.dtype:
        w13, w2 = w13.to(x.dtype), w2.to(x.dtype)
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_tokens = torch.arange(tokens, device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1).float()
    for expert in flat_ids.unique().tolist():
        pick = (flat_ids == expert).nonzero().squeeze(1)
        rows = flat_tokens[pick]
        gate_up = F.linear(x[rows], w13[expert])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[expert])
        out.index_add_(0, rows, y.float() * flat_weights[pick, None])
    return out.to(x.dtype)
