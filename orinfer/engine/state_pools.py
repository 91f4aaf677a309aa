"""The per-sequence state of a hybrid model's linear-attention layers (Qwen3.5's Gated DeltaNet).

Each such layer (`model.state_layers()`) gets two pools with one slot per sequence that may run (max_num_seqs): conv
states [slots, C, K-1] in the activation dtype (the last K-1 conv inputs) and delta-rule states [slots, Hv, Dk, Dv]
in fp32. A running sequence owns one slot index across all layers (`Sequence.state_slot`, handed out by the block
manager); its first step ignores the slot's old contents (`AttentionMetadata.has_initial_state`), so slots are never
cleared. One more slot, `scratch_slot`, belongs to nobody: CUDA-graph padding rows and sequences update it. After it
come `num_snapshots` snapshot slots: copies of a sequence's state at a block boundary, for prefix-cache hits (the
block manager names them; `save` and `restore` copy on the device, in stream order with the steps). The pools come
out of the KV cache's memory budget. Under tensor parallelism each rank's pools hold its shard's heads (the rank's
config), and rank 0's copies are repeated on every rank (`before_copy`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

import torch
from torch import nn

from orinfer.config import ModelConfig
from orinfer.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


class StatePools:
    def __init__(self, model: nn.Module, cfg: ModelConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device, num_snapshots: int = 0, num_work_slots: int = 0) -> None:
        """`num_slots` 0 (models without linear attention): nothing is allocated."""
        self.model, self.cfg, self.dtype, self.device = model, cfg, dtype, device
        self.num_slots = num_slots if cfg.is_hybrid else 0
        self.num_snapshots = num_snapshots if self.num_slots else 0
        self.num_work_slots = num_work_slots if self.num_slots else 0
        self.scratch_slot = self.num_slots
        self.first_work_slot = self.num_slots + 1 + self.num_snapshots
        self.conv_pool: torch.Tensor | None = None  # [layers, slots, C, K-1]
        self.ssm_pool: torch.Tensor | None = None   # [layers, slots, Hv, Dk, Dv] fp32
        # Called with (source slot, destination slot) before each copy: tensor parallelism's rank 0 sends it to the
        # workers, whose runners make the same copy (distributed/executor.py).
        self.before_copy: Callable[[int, int], None] | None = None

    @property
    def bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.total_slots * self.cfg.state_bytes_per_sequence(elem) if self.num_slots else 0

    @property
    def total_slots(self) -> int:
        return self.num_slots + 1 + self.num_snapshots + self.num_work_slots

    def _snapshot_slot(self, snapshot: int) -> int:
        if not 0 <= snapshot < self.num_snapshots:
            raise IndexError(f"snapshot {snapshot} out of range ({self.num_snapshots} kept)")
        return self.num_slots + 1 + snapshot

    def save(self, slot: int, snapshot: int) -> None:
        """Copies sequence slot `slot`'s state (every linear-attention layer) into snapshot `snapshot`."""
        self.copy(slot, self._snapshot_slot(snapshot))

    def restore(self, snapshot: int, slot: int) -> None:
        """Copies snapshot `snapshot` into sequence slot `slot`."""
        self.copy(self._snapshot_slot(snapshot), slot)

    def copy(self, src: int, dst: int) -> None:
        """Copies slot `src`'s state (every linear-attention layer) into slot `dst`."""
        if self.before_copy is not None:
            self.before_copy(src, dst)
        self.conv_pool[:, dst].copy_(self.conv_pool[:, src])
        self.ssm_pool[:, dst].copy_(self.ssm_pool[:, src])

    def copy_many(self, src: list[int], dst: list[int]) -> None:
        """Copies slot src[i] into dst[i], every layer at once: 2 strided copies a slot, each reading and writing the
        slot's state once (an indexed copy would pass through a gathered temporary: 3 passes). Not mirrored to
        tensor-parallel workers by itself: its caller (StateRollback.start) is."""
        for s, d in zip(src, dst):
            self.conv_pool[:, d].copy_(self.conv_pool[:, s])
            self.ssm_pool[:, d].copy_(self.ssm_pool[:, s])

    def _bind(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New zeroed pools of `slots` slots, bound to the layers as views; returns (conv pool, ssm pool)."""
        cfg = self.cfg
        layers = self.model.state_layers()
        conv = torch.zeros(len(layers), slots, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=self.dtype,
                           device=self.device)
        ssm = torch.zeros(len(layers), slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, dtype=torch.float32, device=self.device)
        for index, layer in enumerate(layers):
            layer.conv_states, layer.ssm_states = conv[index], ssm[index]
        return conv, ssm

    def allocate(self) -> None:
        """Binds the pools to the model's linear-attention layers."""
        if self.num_slots:
            self.conv_pool, self.ssm_pool = self._bind(self.total_slots)
            log.info("linear-attention state: %d slots, %d prefix-cache snapshots and %d speculative work slots "
                     "(%.1f MiB)", self.num_slots, self.num_snapshots, self.num_work_slots, self.bytes / 2**20)

    @contextlib.contextmanager
    def scratch(self, meta: AttentionMetadata) -> Iterator[None]:
        """For a warm-up forward: scratch pools with one fresh slot per sequence of `meta` (set on it); the pools
        bound before (if any) are put back after."""
        if not self.num_slots:
            yield
            return
        layers = self.model.state_layers()
        kept = [(layer.conv_states, layer.ssm_states) for layer in layers]
        self._bind(meta.num_seqs)
        meta.state_slots = torch.arange(meta.num_seqs, device=self.device)
        meta.has_initial_state = torch.zeros(meta.num_seqs, dtype=torch.bool, device=self.device)
        try:
            yield
        finally:
            for layer, (conv, ssm) in zip(layers, kept):
                layer.conv_states, layer.ssm_states = conv, ssm
