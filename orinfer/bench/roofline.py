"""What a step must move and compute, the denominators of the bench's % of roofline and MFU: bytes of a decode step
(weights, the routed experts a batch is expected to hit, KV cache, linear-attention state) and FLOPs of a prefill."""

from __future__ import annotations

import torch

from orinfer.config import ModelConfig
from orinfer.layers.moe import ExpertWeights


def expected_experts_hit(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts of one sparse layer that `tokens` tokens are expected to use when each picks top_k of
    num_experts uniformly: an expert is missed by a token with probability 1 - k/E, by all B with (1 - k/E)^B, so
    E (1 - (1 - k/E)^B): k for one token, approaching E for large batches (0 without experts)."""
    if num_experts == 0 or tokens == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def routed_expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of all routed experts' weights of `model` (part of its parameters); a shared expert folded into an
    experts module (its last slot, every token reads it) is not routed: its share is left out."""
    return sum(p.numel() * p.element_size() * module.num_routed // module.num_experts
               for module in model.modules() if isinstance(module, ExpertWeights) for p in module.parameters())


def decode_bytes_per_step(cfg: ModelConfig, weight_bytes: int, context: int, kv_elem: int, batch: int = 1,
                          expert_bytes: int | None = None, world_size: int = 1, cache_elem: int | None = None) -> int:
    """Bytes one decode step of `batch` sequences, each `context` tokens long, must move: every weight but the
    embedding table (one row per sequence is read) and the routed experts no token of the step uses, plus the lm_head
    (the same matrix when tied), plus each sequence's KV cache in the full-attention layers and (hybrid models) its
    linear-attention state, read and written back.

    Routed experts: `expected_experts_hit(E, k, batch)` of each sparse layer's E (uniform routing; the shared
    expert, router and attention are dense weights, read once). `expert_bytes` is what all routed experts take
    (part of `weight_bytes`: `routed_expert_bytes(model)`); by default cfg's shapes at 2 bytes a weight.
    Tensor parallelism: `cfg` and `weight_bytes` are one rank's shard, whose embedding holds ceil(V / world_size)
    rows. `kv_elem`: the activation element size (a hybrid model's conv state); `cache_elem`: the KV cache's (1 for
    an fp8 cache; default kv_elem)."""
    embed = -(-cfg.vocab_size // world_size) * cfg.hidden_size * 2
    weights = weight_bytes - (0 if cfg.tie_word_embeddings else embed)
    if cfg.is_moe:
        routed = cfg.num_sparse_layers * cfg.num_experts * cfg.expert_parameters * 2 if expert_bytes is None \
            else expert_bytes
        hit = expected_experts_hit(cfg.num_experts, cfg.num_experts_per_tok, batch) / cfg.num_experts
        weights -= routed * (1.0 - hit)
    kv = 2 * cfg.num_kv_layers * context * cfg.kv_size * (kv_elem if cache_elem is None else cache_elem)
    state = 2 * cfg.state_bytes_per_sequence(kv_elem) if cfg.is_hybrid else 0
    return round(weights + batch * (kv + state))


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of a prefill of `tokens`: projections, MLP (an MoE layer's router, top_k routed experts and
    shared expert per token), causal attention in the full-attention layers, the delta rule in the linear-attention
    ones (chunks of 64: the state read and update, 6 Dk Dv per token and head, and the in-chunk products,
    2 * 64 (2 Dk + Dv)), one lm_head row."""
    h, layers, kv_layers = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_kv_layers
    q_width = 2 * cfg.q_size if cfg.attn_output_gate else cfg.q_size
    mlp = 2 * tokens * sum(cfg.mlp_parameters(index, active=True) for index in range(layers))
    proj = 2 * tokens * (h * (q_width + 2 * cfg.kv_size) + cfg.q_size * h)
    attn = 2 * 2 * cfg.num_attention_heads * cfg.head_dim * tokens * tokens / 2  # QK^T and PV, causal half
    total = mlp + kv_layers * (proj + attn) + 2 * h * cfg.vocab_size
    if cfg.is_hybrid:
        dk, dv, heads = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
        linear_proj = 2 * tokens * h * (cfg.linear_conv_dim + 2 * cfg.linear_value_dim + 2 * heads)
        delta = tokens * heads * (6 * dk * dv + 2 * 64 * (2 * dk + dv))
        total += (layers - kv_layers) * (linear_proj + delta)
    return total
