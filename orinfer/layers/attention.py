"""Self-attention over the paged KV cache, and the per-step batch description it reads.

The model runner fills an `AttentionMetadata` for each step; every attention layer reads it. Tokens of all sequences
in the step are concatenated into one flat batch of T rows ("varlen"), so prompts, prompt chunks and decode rows
share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from orinfer.kernels.rotary import KVStore
from orinfer.layers.ops import Ops


@dataclass
class AttentionMetadata:
    """What one forward step looks like, for B sequences and T new tokens in all.

    query_start_loc [B+1] int32: row offsets of each sequence's new tokens in the flat batch.
    context_lens [B] int32: tokens of each sequence in the cache after this step (prefix + new tokens).
    block_tables [B, max_blocks] int32 and slot_mapping [T] int64: where each token's K/V lives; None when the
    forward runs without a cache (training, warm-up), in which case every sequence is attended from scratch.
    """

    # Every sequence's new tokens start at position 0 (whole prompts, nothing cached): this step's own K/V are the
    # whole context, so attention needs no reads from the cache. False when any row continues a cached context (decode
    # rows, prompt chunks after the first, prefix-cache hits).
    from_start: bool
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    max_query_len: int
    max_context_len: int
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    # CUDA-graph capture of a mixed step (engine/step_graphs.py): rows and sequences are padded to fixed counts
    # (padding rows past query_start_loc[-1], empty padding sequences), and attention must launch from the shapes
    # alone, never from max_query_len.
    fixed_launch: bool = False
    # Hybrid models (linear-attention layers): each sequence's state slot [B] int64 or int32, and whether it continues
    # a state ([B] bool or int, nonzero: yes; zero: its first token is in this step, the slot's contents are ignored).
    state_slots: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    # Hybrid models under speculative decoding: each linear-attention layer hands this its conv inputs [T, C] and gate
    # inputs [T, 2 Hv] (engine/state_rollback.py keeps the verify rows' ones to roll the state back).
    keep_linear_inputs: Callable[[nn.Module, torch.Tensor, torch.Tensor], None] | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


class Attention(nn.Module):
    """Stores this step's K/V in the layer's cache, then attends each query over its sequence's cached keys.

    An fp8 cache (`kernels/kv_fp8.py`) comes with per-KV-head scales; every attention then reads K/V from the cache,
    the step's own tokens included, so a token's keys are the same quantized values whether they were computed in
    this step, an earlier prompt chunk, or came from the prefix cache: outputs do not depend on how a prompt was
    chunked or what was cached.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        # Bound by the model runner once the pool is allocated; [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # An fp8 cache's per-KV-head scales [Hk] fp32 (bound with it; None for a 16/32-bit cache).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # While the engine calibrates those scales (engine/kv_calibration.py): the largest |K| and |V| seen per KV
        # head, [2, Hk] fp32, updated by every forward.
        self.kv_amax: torch.Tensor | None = None

    def kv_store(self, v: torch.Tensor, meta: AttentionMetadata) -> KVStore | None:
        """Where this step's K/V go (for the RoPE kernel to write them: one launch less per layer), or None when
        the forward runs without a cache."""
        if self.k_cache is None or meta.slot_mapping is None:
            return None
        return KVStore(v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_stored: bool = False) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hk*D] -> [T, Hq*D]. kv_stored: k and v are already in the cache (`kv_store`)."""
        tokens = q.shape[0]
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.kv_amax is not None:
            self._record_amax(k, v)
        target = None if kv_stored else self.kv_store(v, meta)
        if target is not None:
            self.ops.store_kv(k, v, target.k_cache, target.v_cache, target.slot_mapping, k_scale=self.k_scale,
                              v_scale=self.v_scale)
        reads_cache = self.k_scale is not None and meta.slot_mapping is not None  # fp8: always from the cache
        if meta.from_start and not reads_cache:
            # The fresh k/v are the whole context: a varlen flash kernel, no reads from the cache.
            out = self.ops.varlen_attention(q, k, v, meta.query_start_loc, self.scale, max_seqlen=meta.max_query_len)
        else:
            out = self.ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens,
                                           meta.query_start_loc, self.scale, max_query_len=meta.max_query_len,
                                           fixed_launch=meta.fixed_launch, k_scale=self.k_scale,
                                           v_scale=self.v_scale)
        return out.reshape(tokens, self.num_heads * self.head_dim)

    def _record_amax(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Folds this step's largest |K| and |V| per KV head ([T, Hk, D] each) into `kv_amax`."""
        step = torch.stack([k.detach().abs().amax(dim=(0, 2)), v.detach().abs().amax(dim=(0, 2))]).float()
        torch.maximum(self.kv_amax, step, out=self.kv_amax)
