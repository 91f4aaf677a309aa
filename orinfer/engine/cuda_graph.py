"""CUDA-graph replay of decode steps.

A decode step of a 36-layer model launches a few hundred small kernels; at batch 1 each runs for microseconds, so
launch overhead and Python would dominate. Capturing the whole step (embedding -> logits) once per batch bucket and
replaying it removes both. Replay needs fixed addresses and shapes, so inputs go through static buffers sized for the
largest bucket; a batch of B runs in the smallest bucket >= B with padding rows that write nowhere (slot -1) and
attend over one harmless cached slot. Kernels must not sync with the host (the triton backend's decode path does not).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from orinfer.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_batch (as vLLM does: fewer wasted rows for mid-size batches)."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch]
    buckets += list(range(16, max_batch + 1, 16))
    if not buckets or buckets[-1] < max_batch:
        buckets.append(max_batch)
    return buckets


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.model, self.device = model, device
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, batch: int, max_context_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False, query_start_loc=self.query_start_loc[:batch + 1],
            context_lens=self.context_lens[:batch], max_query_len=1, max_context_len=max_context_len,
            slot_mapping=self.slot_mapping[:batch], block_tables=self.block_tables[:batch])

    def _forward(self, batch: int) -> torch.Tensor:
        meta = self._meta(batch, self.block_tables.shape[1])
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first so that smaller graphs reuse its memory pool."""
        for batch in reversed(self.buckets):
            self._forward(batch)  # warm-up: compiles Triton kernels and fixes autotuning outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[batch] = self._forward(batch)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replays the bucket for this batch; returns logits [B, V] (a view into the graph's output buffer)."""
        batch = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= batch)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.context_lens[:batch].copy_(meta.context_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        if bucket > batch:  # padding rows: write no KV, read one slot
            self.slot_mapping[batch:bucket].fill_(-1)
            self.context_lens[batch:bucket].fill_(1)
            self.block_tables[batch:bucket, 0].fill_(0)
        self.graphs[bucket].replay()
        return self.logits[bucket][:batch]
