"""Mixture-of-experts references: routing and the expert FFN, the contract the Triton MoE kernels implement.

A sparse MoE block (Qwen3-MoE, the Qwen3.5-family MoE, Qwen3-VL-MoE) sends each token to `top_k` of `E` experts:

    probs = softmax(router_logits) in fp32                      [T, E]
    weights, ids = top_k(probs)                                 [T, k] each
    weights /= weights.sum(-1)              (norm_topk_prob: renormalised over the chosen k)
    out[t] = sum_j weights[t, j] * FFN_{ids[t, j]}(x[t])
    FFN_e(x) = (silu(x Wg_e^T) * (x Wu_e^T)) Wd_e^T

Expert weights are packed at load into two tensors: `w13` [E, 2I, H] (gate rows 0..I-1, then up rows I..2I-1, as HF
transformers' `gate_up_proj`) and `w2` [E, H, I] (`down_proj`). A shared expert, when the model has one, runs every
token scaled by sigmoid(its gate's logit); its [1, H] gate is one more row of the router's weight, so `moe_router_ref`
(the router's linear and the routing as one op) computes that logit beside the routing. Either the shared expert is
an ordinary MLP outside these ops (the router returns the logit and `shared_expert_combine_ref` adds sigmoid(logit)
times its output to the experts'), or it is folded into the experts as slot E (w13 / w2 then hold E + 1 experts):
the router then appends the pair (sigmoid(logit), E) to each token's top-k (`moe_route_ref`'s `shared_logit`), so
the expert ops run it beside the routed ones, k + 1 pairs a token (layers/moe.py; kernels/moe_route.py,
moe_router.py and moe_shared.py: the Triton kernels).

The Triton path (`kernels/moe_ops.py`) sorts the (token, slot) pairs by expert first (`moe_align_ref` is that
intermediate's contract), so each expert's weights are read once per block of its rows.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                  shared_logit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype) -> (weights [T, top_k] fp32, expert ids [T, top_k] int32).

    Softmax over all experts in fp32, the top_k largest (ties: the lower expert id, by a stable sort: torch.topk
    leaves the order of ties unspecified, and on the CPU takes the higher ids), divided by their sum when
    `renormalize`. The weights stay fp32; the expert op rounds them where it multiplies.

    With `shared_logit` [T, 1] (a folded shared expert's gate logit, any float dtype) each token gets one more pair,
    last: weight sigmoid(shared_logit) in fp32, id E (the shared expert's slot); [T, top_k + 1] each. It is never part
    of the renormalisation, which sums the routed top_k alone."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if shared_logit is not None:
        weights = torch.cat([weights, torch.sigmoid(shared_logit.float())], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], router_logits.shape[1])], dim=1)
    return weights, ids.to(torch.int32)


def moe_router_ref(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, num_experts: int,
                   fold_shared: bool = False, *, linear: Callable | None = None, route: Callable = moe_route_ref
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T, H], the router's weight [N, H] with N = E (`num_experts`) or E + 1 (the last row: the shared expert's
    gate, layers/moe.py) -> (weights [T, top_k] fp32, ids [T, top_k] int32, shared_logit [T, 1] in x's dtype or
    None when N = E).

    logits = x W^T in x's dtype (F.linear, a 16-bit W widened for fp32 x, as every reference linear); the first E
    columns are routed (`route`: `moe_route_ref`'s contract), column E is the shared expert's gate logit.
    `fold_shared` (N = E + 1: the shared expert is the experts' slot E): that logit goes to `route` as its
    `shared_logit`, so weights and ids are [T, top_k + 1], the last pair (sigmoid(logit), E), and no logit is
    returned (None). A backend may pass its own `linear` (with that contract) and `route` (the triton backend does,
    for more tokens than kernels/moe_router.py's fused launch takes)."""
    if fold_shared and weight.shape[0] != num_experts + 1:
        raise ValueError(f"moe_router: folding the shared expert needs its gate row after the {num_experts} "
                         f"experts' rows, weight has {weight.shape[0]} rows")
    if linear is None:
        logits = F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype))
    else:
        logits = linear(x, weight)
    shared = logits[:, num_experts:] if weight.shape[0] > num_experts else None
    if fold_shared:
        return (*route(logits[:, :num_experts], top_k, renormalize, shared_logit=shared), None)
    weights, ids = route(logits[:, :num_experts], top_k, renormalize)
    return weights, ids, shared


def shared_expert_combine_ref(experts_out: torch.Tensor, shared_out: torch.Tensor, gate_logit: torch.Tensor
                              ) -> torch.Tensor:
    """experts_out, shared_out [T, H], gate_logit [T, 1] -> experts_out + sigmoid(gate_logit) * shared_out [T, H]:
    fp32 math, rounded once to experts_out's dtype (the Qwen3.5-MoE block's sum of its routed and gated shared
    expert)."""
    gate = torch.sigmoid(gate_logit.float())
    return (experts_out.float() + gate * shared_out.float()).to(experts_out.dtype)


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


def moe_align_size(pairs: int, num_experts: int, block_m: int) -> int:
    """The fixed length of `moe_align`'s sorted list: every expert segment padded to a multiple of block_m takes at
    most pairs + min(pairs, E) * (block_m - 1) entries (only chosen experts have a segment), rounded to whole
    blocks. Known on the host from the shapes alone, so the buffers are CUDA-graph safe."""
    used = min(pairs, num_experts)
    return -(-(pairs + used * (block_m - 1)) // block_m) * block_m


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pairs [P] int32, block_expert [P / block_m] int32), P = `moe_align_size`.

    The pairs are numbered p = t * k + j (row-major over topk_ids). sorted_pairs lists them by expert, ascending,
    and within an expert in ascending p (a stable sort); each expert's segment starts at a multiple of block_m and is
    padded up to one with the value T * k (no pair); the tail after the last segment holds T * k too. block_expert[b]
    is the expert whose segment holds block b, or -1 for the blocks past the last segment."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    size = moe_align_size(pairs, num_experts, block_m)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts                   # where each expert's pairs begin in `order`
    expert_of = flat[order]
    positions = starts[expert_of] + torch.arange(pairs, device=flat.device) - first[expert_of]
    sorted_pairs = torch.full((size,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[positions] = order.to(torch.int32)
    block_expert = torch.full((size // block_m,), -1, dtype=torch.int32, device=flat.device)
    blocks = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    block_expert[: blocks.numel()] = blocks.to(torch.int32)
    return sorted_pairs, block_expert
