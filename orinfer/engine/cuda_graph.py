"""CUDA-graph replay of decode steps.

A decode step of a 36-layer model launches a few hundred small kernels; at batch 1 each runs for microseconds, so
launch overhead and Python would dominate. Capturing the whole step (embedding -> logits) once per batch bucket and
replaying it removes both. Replay needs fixed addresses and shapes, so inputs go through static buffers sized for the
largest bucket; a batch of B runs in the smallest bucket >= B with padding rows that write nowhere (slot -1) and
attend over one harmless cached slot. Kernels must not sync with the host (the triton backend's decode path does not).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from orinfer.engine.graph_capture import capture_graph
from orinfer.layers.attention import AttentionMetadata
from orinfer.layers.ops import GraphHooks

log = logging.getLogger(__name__)


# Greedy lookahead steps of up to this many rows read their ids where the previous replay left them (`run`). AWQ
# bench on the H200, in place against copied: batch 1 561 against 544 tok/s; batch 32 6346 against 6827, for a reason
# not found yet, so larger batches keep the copy. (Against the sampler outside the graph and the copy: batch 16 4712
# against 4582, batch 48 7667 against 7749.)
IN_PLACE_MAX_ROWS = 16

# Decode attention bounds its split count by the width of the block table it is given (kernels/decode_attention.py).
# Over the full table, batch 1 splits every context 32 ways (Qwen3-8B: 8 kv heads, 132 SMs) and at a few hundred tokens
# most splits are empty; a step then takes ~20 us longer (step replay: 1.813 ms with 32 splits, 1.794 with 16,
# 1.792 with 8; empty splits skipping all of their work inside the kernel: 1.813-1.818). So the smallest buckets get a
# second graph over the table's first SHORT_CONTEXT_TOKENS tokens, replayed while the batch's longest context fits in
# it: 16 splits at batch 1, the fastest count up to ~1k tokens. Longer contexts replay the full graph.
SHORT_CONTEXT_TOKENS = 1024
SHORT_CONTEXT_MAX_BATCH = 2  # buckets above it get no more splits than the short table allows anyway


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_batch (as vLLM does: fewer wasted rows for mid-size batches)."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch]
    buckets += list(range(16, max_batch + 1, 16))
    if not buckets or buckets[-1] < max_batch:
        buckets.append(max_batch)
    return buckets


class DecodeGraphs:
    def __init__(self, model: nn.Module, hooks: GraphHooks, max_batch: int, max_blocks_per_seq: int,
                 device: torch.device, block_size: int, pool: tuple | None = None,
                 state_scratch_slot: int | None = None) -> None:
        """Graphs for up to `max_batch` rows of up to `max_blocks_per_seq` KV-cache blocks of `block_size` tokens,
        captured with the backend's `hooks` (greedy argmax, input advance, capture scope). Buckets of up to
        SHORT_CONTEXT_MAX_BATCH rows also get a graph for contexts of up to SHORT_CONTEXT_TOKENS tokens (see there),
        when the full table is wider than that. `pool`: a graph memory pool to share (the mixed-step graphs': steps
        never overlap, and each step's outputs are read before the next replay). `state_scratch_slot` (hybrid
        models): rows also carry their sequence's linear-attention state slot; padding rows use this one."""
        self.model, self.hooks, self.device, self.block_size = model, hooks, device, block_size
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        n, self.max_blocks = self.max_batch, max_blocks_per_seq
        # The graph's inputs live in two device buffers (one per dtype) whose pinned host twins the step fills in
        # place: a step costs two asynchronous copies, not one upload per field. Rows: ids, positions, slots, and
        # the host-ids row below (int64); context lengths then block tables (int32). The host twins come in two sets
        # used in turn: with the engine's lookahead, step N+1 is prepared while step N's copies may not have run yet
        # (the host last waited for step N-1), so it must not rewrite the set they read. An event after each set's
        # replay guards the reuse.
        self.staging = [_Staging(n, max_blocks_per_seq, index) for index in range(2)]
        self.turn = 0
        # Row 4: each row's linear-attention state slot (hybrid models; a decode row always continues its state).
        self.state_scratch_slot = state_scratch_slot
        self.dev_i64 = torch.zeros(5, n, dtype=torch.int64, device=device)
        self.state_slots = self.dev_i64[4]
        self.state_slots.fill_(state_scratch_slot or 0)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=device)
        self.dev_i32 = torch.zeros(n + n * max_blocks_per_seq, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.dev_i64[0], self.dev_i64[1], self.dev_i64[2]
        # Each replay's argmax also writes its ids straight into pinned host memory, row host_row[0] of host_ids: the
        # index of the staging set that fed it (each set uploads its own index; `advance_decode_inputs` flips it
        # when nothing is uploaded). The host then reads them after the step's event, with no device-to-host copy
        # queued between two replays (14 -> 12 us between them at batch 1; the
        # uploads were the rest). A row is rewritten by the replay two after, which the engine queues only once it
        # has read this one (its lookahead is one step deep).
        self.host_ids = torch.zeros(2, n, dtype=torch.int64, pin_memory=True)
        self.host_row = self.dev_i64[3, :1]
        self.last_staging = 0
        # What the device's inputs hold once the last replay has advanced them (`advance_decode_inputs`): per row,
        # the sequence, its expected token count and the block table last uploaded for it. None: unknown.
        self.advanced: list[tuple[object, int, list[int]]] | None = None
        self.context_lens = self.dev_i32[:n]
        self.block_tables = self.dev_i32[n:].view(n, max_blocks_per_seq)
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        short = -(-SHORT_CONTEXT_TOKENS // block_size)
        self.short_blocks = short if short < max_blocks_per_seq else 0
        self.short_tokens = self.short_blocks * block_size
        self.short_buckets = [b for b in self.buckets if b <= SHORT_CONTEXT_MAX_BATCH] if self.short_blocks else []
        self.short_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.short_logits: dict[int, torch.Tensor] = {}
        self.pool = pool
        # Each graph's hidden states [bucket, H] (before the lm_head), by (bucket, block columns): an MTP head reads
        # them (`last_hidden`); holding them keeps a few KiB per graph out of the pool's reuse.
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.last_key: tuple[str, int, bool] | None = None
        # Tensor parallelism (rank 0): called with each replay's key and input buffers just before the replay, so
        # that the workers replay theirs on the same inputs (distributed/mirror.py).
        self.before_replay: Callable[[tuple, list[torch.Tensor]], None] | None = None

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        """The decode step over the first `blocks` columns of the block table (contexts of up to that many blocks)."""
        meta = AttentionMetadata(
            from_start=False, query_start_loc=self.query_start_loc[:batch + 1],
            context_lens=self.context_lens[:batch], max_query_len=1, max_context_len=blocks * self.block_size,
            slot_mapping=self.slot_mapping[:batch], block_tables=self.block_tables[:batch, :blocks])
        if self.state_scratch_slot is not None:
            meta.state_slots, meta.has_initial_state = self.state_slots[:batch], self.has_initial_state[:batch]
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], meta)
        self._captured_hidden = hidden  # kept as an output of the graph being captured (`last_hidden`)
        return self.model.compute_logits(hidden)

    def _capture(self, batch: int, blocks: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up: compiles Triton kernels, fixes autotuning and builds the L2 prefetch plans outside the capture.
        hooks = self.hooks
        with hooks.capture_scope(self.device, launch=False):
            self._forward(batch, blocks)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, pool=self.pool), hooks.capture_scope(self.device, launch=True):
            logits = self._forward(batch, blocks)
            # The greedy samples go where the next step reads its input ids (`greedy_ids`): a greedy lookahead step
            # then needs neither sampler launches nor a copy of the ids before its replay. Other batches ignore them
            # (a few us against their sampler's sort over the vocabulary).
            hooks.argmax_rows(logits, out=self.input_ids[:batch], mirror=self.host_ids, mirror_row=self.host_row)
            # Then the inputs move to the rows' next tokens, which a continuing batch can replay without an upload.
            hooks.advance_decode_inputs(self.positions[:batch], self.context_lens[:batch], self.slot_mapping[:batch],
                                  self.block_tables[:batch], self.block_size, self.host_row)
        if self.pool is None:
            self.pool = graph.pool()
        self.hidden[(batch, blocks)] = self._captured_hidden
        return graph, logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first so that smaller graphs reuse its memory pool, then the short-context
        graphs."""
        for batch in reversed(self.buckets):
            self.graphs[batch], self.logits[batch] = self._capture(batch, self.max_blocks)
        for batch in reversed(self.short_buckets):
            self.short_graphs[batch], self.short_logits[batch] = self._capture(batch, self.short_blocks)
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s (and %s for contexts of up to %d tokens)",
                 self.buckets, self.short_buckets, self.short_tokens)

    def release(self) -> None:
        """Frees every captured graph (tensor parallelism: NCCL cannot tear a communicator down while graphs that
        hold its kernels live, pytorch/pytorch#115388)."""
        for graph in (*self.graphs.values(), *self.short_graphs.values()):
            graph.reset()
        self.graphs.clear()
        self.short_graphs.clear()

    def graph_key(self, bucket: int, longest_context: int) -> tuple[str, int, bool]:
        """Names the graph that replays `bucket` rows whose longest context is `longest_context` tokens."""
        return "decode", bucket, bucket in self.short_graphs and longest_context <= self.short_tokens

    def graph_for(self, key: tuple[str, int, bool]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of `key` and its logits."""
        _, bucket, short = key
        if short:
            return self.short_graphs[bucket], self.short_logits[bucket]
        return self.graphs[bucket], self.logits[bucket]

    def graph_inputs(self, key: tuple[str, int, bool]) -> list[torch.Tensor]:
        """The device buffers graph `key` reads its inputs from (tensor parallelism broadcasts rank 0's)."""
        return [self.dev_i64, self.dev_i32[:self.max_batch + key[1] * self.max_blocks]]

    def last_hidden(self, batch: int) -> torch.Tensor:
        """The last replay's hidden states [batch, H] (a view of the graph's buffer: read it in stream order before
        the next replay)."""
        _, bucket, short = self.last_key
        return self.hidden[(bucket, self.short_blocks if short else self.max_blocks)][:batch]

    def _replay(self, key: tuple[str, int, bool]) -> torch.Tensor:
        self.last_key = key
        graph, logits = self.graph_for(key)
        if self.before_replay is not None:
            self.before_replay(key, self.graph_inputs(key))
        graph.replay()
        return logits

    def run(self, seqs: list, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replays the bucket for these decoding sequences; returns logits [B, V] (a view of the graph's output).

        Each sequence contributes its newest token, at position num_tokens - 1 (plus its M-RoPE delta: a Qwen3-VL
        sequence with images decodes with plain RoPE at shifted positions, so the same graphs serve it).
        `device_ids` [B] (lookahead): the input ids, already on the device (the previous step's samples, whose
        host copies do not exist yet); they are copied over the ids row on the device, unless they are the previous
        replay's `greedy_ids` for this same batch, already in place. A lookahead step that continues the last
        replay's batch also finds its other inputs in place (`advance_decode_inputs`) and uploads nothing.
        """
        batch = len(seqs)
        bucket = next(b for b in self.buckets if b >= batch)
        stage = self.staging[self.turn]
        self.last_staging = self.turn
        self.turn ^= 1
        stage.replayed.synchronize()  # the replay that last read this set (two steps ago): long done in practice
        aliased = device_ids is not None and device_ids.data_ptr() == self.input_ids.data_ptr()
        in_place = aliased and device_ids.shape[0] == batch and batch <= IN_PLACE_MAX_ROWS
        if aliased and not in_place:
            device_ids = device_ids.clone()  # an upload or the copy below rewrites the row they live in
        tables = self._advanced_tables(seqs) if device_ids is not None else None
        if tables is None:
            # A copy right before the replay, even of 8 bytes, made the batch-1 AWQ replay that follows it 0.05 ms
            # slower: ids already in place skip the ids row of the upload.
            tables = self._upload(stage, seqs, bucket, first_row=1 if in_place else 0)
        if device_ids is not None and not in_place:
            self.input_ids[:batch].copy_(device_ids)  # queued after any upload above, so it wins
        logits = self._replay(self.graph_key(bucket, max(seq.num_tokens for seq in seqs)))
        stage.replayed.record()
        self.advanced = [(seq, seq.num_tokens + 1, table) for seq, table in zip(seqs, tables)]
        return logits[:batch]

    def replay_advanced(self, batch: int, longest_context: int) -> torch.Tensor:
        """Replays the last `run`'s bucket again on the inputs that replay advanced to: each row's input id is its own
        greedy sample, one position further (greedy multi-step decode on the device: a draft model's proposals).
        The rows' block tables must already hold the slots of the positions reached. Returns logits [batch]."""
        bucket = next(b for b in self.buckets if b >= batch)
        logits = self._replay(self.graph_key(bucket, longest_context))
        self.advanced = None  # the host no longer knows which tokens the inputs hold
        return logits[:batch]

    def _advanced_tables(self, seqs: list) -> list[list[int]] | None:
        """The block tables last uploaded for `seqs` when the device's inputs already are this step's: the last
        replay ran these sequences in this order, each has gained exactly one token since, and the block of its
        newest token is in the table uploaded for it (unchanged). Else None: the step needs an upload."""
        advanced, block_size = self.advanced, self.block_size
        if advanced is None or len(advanced) != len(seqs):
            return None
        for seq, (last_seq, num_tokens, table) in zip(seqs, advanced):
            if (seq is not last_seq or seq.num_tokens != num_tokens or (num_tokens - 1) // block_size >= len(table)
                    or seq.block_table[:len(table)] != table):
                return None
        return [table for _, _, table in advanced]

    def _upload(self, stage: _Staging, seqs: list, bucket: int, first_row: int) -> list[list[int]]:
        """Fills `stage` with the step's inputs and queues its copies to the device (int64 rows from `first_row`);
        returns the block tables uploaded."""
        block_size, batch, n = self.block_size, len(seqs), self.max_batch
        ids, positions, slots = stage.np_i64[:3]
        state_slots = stage.np_i64[4]
        lens = stage.np_i32[:n]
        tables = stage.np_i32[n:].reshape(n, self.max_blocks)
        uploaded = []
        for i, seq in enumerate(seqs):
            pos = seq.num_tokens - 1
            ids[i], positions[i] = seq.token_ids[-1], pos + seq.rope_delta  # M-RoPE: shifted, same on all axes
            slots[i] = seq.block_table[pos // block_size] * block_size + pos % block_size
            lens[i] = seq.num_tokens
            state_slots[i] = seq.state_slot
            tables[i, :len(seq.block_table)] = seq.block_table
            uploaded.append(list(seq.block_table))
        # Padding rows of the bucket write no KV (slot -1) and attend over one slot of block 0.
        ids[batch:bucket], positions[batch:bucket], slots[batch:bucket] = 0, 0, -1
        state_slots[batch:bucket] = self.state_scratch_slot or 0
        lens[batch:bucket] = 1
        tables[batch:bucket, 0] = 0
        self.dev_i64[first_row:].copy_(stage.i64[first_row:], non_blocking=True)
        used = n + bucket * self.max_blocks
        self.dev_i32[:used].copy_(stage.i32[:used], non_blocking=True)
        return uploaded

    def greedy_ids(self, batch: int) -> torch.Tensor:
        """The last replay's argmax of the logits [batch] int64: a view of the input ids row, which the next step's
        upload or replay overwrites (read it in stream order before then, as the engine's lookahead does)."""
        return self.input_ids[:batch]

    def greedy_host_ids(self, batch: int) -> torch.Tensor:
        """The same ids in pinned host memory, written by the last replay itself: valid once an event recorded after
        that replay has passed, until the replay two after it."""
        return self.host_ids[self.last_staging, :batch]


class _Staging:
    """One set of pinned host buffers for the graph inputs (see DecodeGraphs.__init__)."""

    def __init__(self, n: int, max_blocks: int, index: int) -> None:
        self.i64 = torch.zeros(5, n, dtype=torch.int64, pin_memory=True)
        self.i64[3] = index  # the row of DecodeGraphs.host_ids that replays fed by this set write
        self.i32 = torch.zeros(n + n * max_blocks, dtype=torch.int32, pin_memory=True)
        self.np_i64, self.np_i32 = self.i64.numpy(), self.i32.numpy()
        self.replayed = torch.cuda.Event()  # recorded after the replay that read this set
