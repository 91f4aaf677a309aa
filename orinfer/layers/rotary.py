"""Rotary embedding module: owns the fp32 cos/sin table and applies (QK-norm +) RoPE through the backend.

Qwen3-VL's three-axis variant (M-RoPE) reuses this module with a per-token table: see layers/mrope.py."""

from __future__ import annotations

import torch
from torch import nn

from orinfer.kernels.rotary import KVStore, rope_cos_sin_cache
from orinfer.layers.ops import Ops


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, ops: Ops, rotary_dim: int | None = None
                 ) -> None:
        """rotary_dim < head_dim (partial rotary, Qwen3.5): RoPE turns the first rotary_dim dims of each head, with
        frequencies of a rotary_dim-wide head; the table is that narrow."""
        super().__init__()
        self.ops, self.head_dim = ops, head_dim
        # Not a checkpoint tensor: persistent=False keeps it out of state_dict; built on the module's device at init.
        self.register_buffer("cos_sin", rope_cos_sin_cache(rotary_dim or head_dim, max_position, base),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                cos_sin: torch.Tensor | None = None, kv_store: KVStore | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(QK-norm +) RoPE of q and k at `positions`, rows of `cos_sin` (default: this module's table); with
        `kv_store` (from `Attention.kv_store`), the new k and v also go into the layer's KV cache in the same kernel.

        A caller-made table serves M-RoPE: one row per token ([T, D], see layers/mrope.py) with positions arange(T).
        """
        return self.ops.qk_norm_rope(
            q, k, positions, self.cos_sin if cos_sin is None else cos_sin, self.head_dim,
            None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
            q_norm.eps if q_norm is not None else 1e-6, kv_store=kv_store)
