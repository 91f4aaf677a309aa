"""CUDA-graph replay of greedy draft proposals: a graph per batch bucket runs a catch-up forward and k - 1 single-row
draft steps, shared by the MTP head (spec_decode/mtp_graphs.py) and a draft model (spec_decode/draft_graphs.py),
which differ in the module each forward runs and in the catch-up rows a sequence may have (R: k + 1 for the MTP
head, 2 for a draft model).

An eager proposal is k forwards, each with its own uploads and launches, and host bookkeeping between them. Here it
is one upload and one replay; the host next waits at the drafts' `.tolist()`.

Layout (a graph per batch bucket B of `batch_buckets`, each for k drafts):
- catch-up: B R rows, the mixed-step graphs' padding rules (engine/step_graphs.py). The real rows of every
  sequence come first, packed (a sequence has 1 .. k + 1 after a verify step, more after steps that did not
  speculate); rows past them have id 0, position 0, KV slot -1 (they store nothing); sequences past the real batch
  are empty (query_start_loc repeats the row count, context 0). Attention launches from the shapes alone
  (`AttentionMetadata.fixed_launch`). A batch of b <= B sequences fits bucket B when its rows fit B R: a
  sequence that caught up on a few extra rows takes a larger bucket rather than the eager path. Fixing the rows per
  bucket, rather than keying graphs by (batch, token) pairs, keeps one graph per batch bucket;
- each sequence's last real row (its sample row; padding sequences: row 0) gives the first draft;
- steps 1 .. k - 1: one row per sequence (decode attention), at positions and slots the host computed from the block
  tables (the blocks were appended before the proposal); padding rows write nowhere (slot -1) and attend over one
  slot of block 0 (context 1), like the decode graphs' padding rows.
Every draft is an argmax written into `drafts` [k, B], whose row s is also step s + 1's input ids.

All inputs sit in one device byte buffer (int64 fields, then int32 fields, the block tables last, so a bucket uploads
only the table rows it reads) filled from one pinned host twin by one asynchronous copy. The graphs share one memory
pool of their own (not the runner's: a deferred sampler may still read a runner graph's logits when drafts run).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Callable, ContextManager, Hashable

import numpy as np
import torch

from orinfer.engine.cuda_graph import batch_buckets
from orinfer.engine.graph_capture import capture_graph
from orinfer.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InputLayout:
    """Where each input field of the proposal graphs lives in their byte buffer, for up to `max_batch` sequences of
    up to `rows_per_seq` catch-up rows each, `k` drafts and block tables `max_blocks` wide. Offsets count elements of
    the field's dtype from the start of its region (int64 fields from byte 0, int32 fields from byte `i32_at`)."""

    max_batch: int
    k: int
    max_blocks: int
    rows_per_seq: int

    @property
    def max_rows(self) -> int:
        """Catch-up rows of the largest bucket."""
        return self.max_batch * self.rows_per_seq

    # The offsets below are cached: `run` reads them on the host's path between a verify step and the next proposal,
    # where recomputing them (numpy products) cost ~110 us a proposal on the H200 machine's host (NOTES run 411).

    # int64 fields: ids, positions, slots [max_rows]; sample_rows [max_batch]; step_positions, step_slots [k-1, B].
    @functools.cached_property
    def i64_fields(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        rows, batch, steps = self.max_rows, self.max_batch, self.k - 1
        sizes = {"ids": (rows,), "positions": (rows,), "slots": (rows,), "sample_rows": (batch,),
                 "step_positions": (steps, batch), "step_slots": (steps, batch)}
        return _offsets(sizes)

    # int32 fields: query_start_loc [B+1], context_lens [B], step_context_lens [k-1, B], block_tables [B, W] (last).
    @functools.cached_property
    def i32_fields(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        batch = self.max_batch
        sizes = {"query_start_loc": (batch + 1,), "context_lens": (batch,), "step_context_lens": (self.k - 1, batch),
                 "block_tables": (batch, self.max_blocks)}
        return _offsets(sizes)

    @functools.cached_property
    def i32_at(self) -> int:
        """Byte offset of the int32 region."""
        return 8 * sum(int(np.prod(shape)) for _, shape in self.i64_fields.values())

    @property
    def nbytes(self) -> int:
        return self.used_bytes(self.max_batch)

    def used_bytes(self, bucket: int) -> int:
        """Bytes that bucket `bucket` reads: everything up to its last block-table row."""
        tables_at, _ = self.i32_fields["block_tables"]
        return self.i32_at + 4 * (tables_at + bucket * self.max_blocks)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of every field in the byte tensor `buffer` [nbytes] uint8 (device buffer or host twin)."""
        out = {}
        for dtype, size, base, fields in ((torch.int64, 8, 0, self.i64_fields),
                                          (torch.int32, 4, self.i32_at, self.i32_fields)):
            for name, (offset, shape) in fields.items():
                count = int(np.prod(shape))
                start = base + size * offset
                out[name] = buffer[start:start + size * count].view(dtype).view(shape)
        return out


def _offsets(sizes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, tuple[int, ...]]]:
    out, at = {}, 0
    for name, shape in sizes.items():
        out[name] = (at, shape)
        at += int(np.prod(shape))
    return out


def pick_bucket(buckets: list[int], rows_per_seq: int, batch: int, rows: int) -> int | None:
    """The smallest bucket of at least `batch` sequences whose B `rows_per_seq` catch-up rows hold `rows`; None:
    none does (the proposal runs eagerly)."""
    return next((b for b in buckets if b >= batch and b * rows_per_seq >= rows), None)


def fill_inputs(host: dict[str, np.ndarray], bucket: int, k: int, tables: list[list[int]], feeds: list[list[int]],
                firsts: list[int], block_size: int) -> int:
    """Writes a proposal's inputs for `bucket` into the host arrays `host` (numpy views of `InputLayout.views`):
    sequence j catches up on feeds[j] at positions firsts[j] .. firsts[j] + len(feeds[j]) - 1 (ending at E_j - 1,
    E_j = firsts[j] + len(feeds[j])); draft step s (1 .. k-1) runs its row at position E_j + s - 1. Its KV slots
    come from tables[j]. (The MTP head feeds token x_{i+1} at position i, so E_j is the newest token's index N_j; a
    draft model feeds x_i, so E_j = N_j + 1.) Padding rows and sequences up to the bucket as the module docstring
    says (every row of `host` past the real ones is padding). Returns the real catch-up rows."""
    batch = len(tables)
    # Built as Python lists, then written with one conversion per field: numpy calls per sequence and step cost
    # ~35 us a sequence on the CPU box (the host waits for this before the replay).
    ids, positions, slots, starts, lens, step_positions, step_slots = [], [], [], [0], [], [], []
    tables_out = host["block_tables"]
    for j, (table, feed, first) in enumerate(zip(tables, feeds, firsts)):
        end = first + len(feed)  # E_j
        span = range(first, end + k - 1)  # the catch-up rows' positions, then the draft steps'
        span_slots = [table[p // block_size] * block_size + p % block_size for p in span]
        ids.extend(feed)
        positions.extend(span[:len(feed)])
        slots.extend(span_slots[:len(feed)])
        step_positions.append(span[len(feed):])
        step_slots.append(span_slots[len(feed):])
        starts.append(len(ids))
        lens.append(end)
        tables_out[j, :len(table)] = table
    rows = len(ids)
    host["ids"][:rows], host["positions"][:rows], host["slots"][:rows] = ids, positions, slots
    host["query_start_loc"][:batch + 1] = starts
    host["context_lens"][:batch] = lens
    host["sample_rows"][:batch] = np.asarray(starts[1:]) - 1
    if batch and k > 1:
        steps = np.array(step_positions, dtype=np.int64).T  # [k - 1, batch]
        host["step_positions"][:, :batch], host["step_context_lens"][:, :batch] = steps, steps + 1
        host["step_slots"][:, :batch] = np.array(step_slots, dtype=np.int64).T
    # Padding: rows that store nothing, empty sequences, single-step rows over one slot of block 0.
    host["ids"][rows:], host["positions"][rows:], host["slots"][rows:] = 0, 0, -1
    if batch < bucket:  # (skipped when the batch fills its bucket: each write costs the waiting device time)
        host["query_start_loc"][batch + 1:bucket + 1] = rows
        host["context_lens"][batch:bucket] = 0
        host["sample_rows"][batch:bucket] = 0
        host["step_positions"][:, batch:bucket], host["step_slots"][:, batch:bucket] = 0, -1
        host["step_context_lens"][:, batch:bucket] = 1
        tables_out[batch:bucket, 0] = 0
    return rows


class ProposalGraphs:
    """The buffers, capture and replay of the proposal graphs, one per key (`graph_keys`: by default, each batch
    bucket); a subclass gives the device work (`_body`), built from `catch_up_meta` and `step_meta`."""

    name = "draft"  # (for the capture's log line)

    def __init__(self, k: int, max_batch: int, max_blocks: int, block_size: int, rows_per_seq: int,
                 device: torch.device, argmax: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                 ) -> None:
        """Graphs for proposals of `k` drafts for up to `max_batch` sequences of up to `max_blocks` KV blocks of
        `block_size` tokens and up to `rows_per_seq` catch-up rows each on average. `argmax(logits [B, V], out [B]
        int64)`: the backend's capturable greedy ids (torch.argmax when None). Until `capture` (and on the CPU, in
        tests), `run` runs the same padded work eagerly."""
        self.k, self.block_size, self.device, self.rows_per_seq = k, block_size, device, rows_per_seq
        self.buckets = batch_buckets(max_batch)
        self.layout = InputLayout(self.buckets[-1], k, max_blocks, rows_per_seq)
        self.max_blocks = max_blocks
        self.argmax = argmax or (lambda logits, out: torch.argmax(logits, dim=-1, out=out))
        cuda = device.type == "cuda"
        self.inputs = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        self.dev = self.layout.views(self.inputs)
        self.staging = torch.zeros(self.layout.nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.host = {name: view.numpy() for name, view in self.layout.views(self.staging).items()}
        # The staging is rewritten only once the last proposal's copy from it has run (in practice long done: the
        # proposer waits for its drafts).
        self.uploaded = torch.cuda.Event() if cuda else None
        self._uploads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.drafts = torch.zeros(k, self.layout.max_batch, dtype=torch.int64, device=device)
        self.decode_starts = torch.arange(self.layout.max_batch + 1, dtype=torch.int32, device=device)
        # At capture every sequence is padding: nothing stored, nothing attended.
        fill_inputs(self.host, self.layout.max_batch, k, [], [], [], block_size)
        self.inputs.copy_(self.staging)
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def bucket_for(self, batch: int, rows: int, widest_table: int) -> int | None:
        """The bucket that runs a proposal for `batch` sequences of `rows` catch-up rows in all whose block tables
        are at most `widest_table` wide; None: it runs eagerly."""
        if widest_table > self.max_blocks:
            return None
        return pick_bucket(self.buckets, self.rows_per_seq, batch, rows)

    def catch_up_meta(self, bucket: int) -> AttentionMetadata:
        """The catch-up forward's attention metadata: B R padded rows over `bucket` sequences."""
        d = self.dev
        rows = bucket * self.rows_per_seq
        return AttentionMetadata(
            from_start=False, query_start_loc=d["query_start_loc"][:bucket + 1], context_lens=d["context_lens"][:bucket],
            max_query_len=rows, max_context_len=self.max_blocks * self.block_size, slot_mapping=d["slots"][:rows],
            block_tables=d["block_tables"][:bucket], fixed_launch=True)

    def step_meta(self, bucket: int, step: int) -> AttentionMetadata:
        """Draft step `step`'s (1 .. k - 1) attention metadata: one row per sequence."""
        d = self.dev
        return AttentionMetadata(
            from_start=False, query_start_loc=self.decode_starts[:bucket + 1],
            context_lens=d["step_context_lens"][step - 1, :bucket], max_query_len=1,
            max_context_len=self.max_blocks * self.block_size, slot_mapping=d["step_slots"][step - 1, :bucket],
            block_tables=d["block_tables"][:bucket])

    def graph_keys(self) -> list[Hashable]:
        """The graphs to capture, the largest first (the smaller ones then reuse its pool)."""
        return list(reversed(self.buckets))

    def bucket_of(self, key: Hashable) -> int:
        """The batch bucket of graph `key`."""
        return key

    def _body(self, key: Hashable) -> None:
        """Graph `key`'s device work, from the input buffers to `drafts`."""
        raise NotImplementedError

    def _scope(self, launch: bool) -> ContextManager:
        """Opened around a graph's warm-up (launch=False) and its capture (launch=True)."""
        return contextlib.nullcontext()

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every graph, each warmed up first (Triton compiles, cuBLAS loads)."""
        for key in self.graph_keys():
            with self._scope(launch=False):
                self._body(key)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph, pool=self.pool), self._scope(launch=True):
                self._body(key)
            self.graphs[key] = graph
            if self.pool is None:
                self.pool = graph.pool()
        torch.cuda.synchronize(self.device)
        log.info("captured %s CUDA graphs (k = %d) for batch sizes %s", self.name, self.k, self.buckets)

    def _fill(self, key: Hashable, tables: list[list[int]], feeds: list[list[int]], firsts: list[int]) -> int:
        """Writes graph `key`'s inputs into the host twin (`fill_inputs`); returns the real catch-up rows."""
        return fill_inputs(self.host, self.bucket_of(key), self.k, tables, feeds, firsts, self.block_size)

    def run(self, key: Hashable, tables: list[list[int]], feeds: list[list[int]], firsts: list[int],
            before_replay: Callable[[int], None] | None = None) -> torch.Tensor:
        """Drafts [B, k] on the device (a view of the graph's buffer: read it before the next proposal) for the B
        sequences of `tables`, catching up on `feeds` from `firsts` (`fill_inputs`), by graph `key` (for the
        buckets' graphs: `bucket_for`). `before_replay(rows)`: queues the subclass's other inputs for the real
        catch-up rows."""
        if self.uploaded is not None:
            self.uploaded.synchronize()
        rows = self._fill(key, tables, feeds, firsts)
        device_part, host_part = self._upload_parts(self.bucket_of(key))
        device_part.copy_(host_part, non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()
        if before_replay is not None:
            before_replay(rows)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self._body(key)
        return self.drafts[:, :len(tables)].t()

    def _upload_parts(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The leading bytes of the input buffer and of its host twin that bucket `bucket` reads, made once per bucket:
        every operation between a verify step's end and the next replay leaves the device idle."""
        parts = self._uploads.get(bucket)
        if parts is None:
            used = self.layout.used_bytes(bucket)
            parts = self._uploads[bucket] = (self.inputs[:used], self.staging[:used])
        return parts

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
