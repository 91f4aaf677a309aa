"""CUDA-graph replay of mixed steps: prompt chunks beside decode rows, short whole prompts, prefix-cache hits.

An eager step of Qwen3-8B launches ~180 Triton kernels and ~144 GEMMs, whose Python launch path costs 16-24 ms of
host time (benchmarks/NOTES.md, runs 258-259): more than the device needs for a step of a few hundred tokens. While
prompts keep arriving, those steps made the serving engine host-bound. Here each bucket of token counts gets one graph
of the forward (embedding -> final norm); a step of T tokens replays the smallest bucket >= T in well under a
millisecond of host time.

Shapes are fixed per bucket, so the batch is padded:
- rows past the real T: id 0, position 0, KV slot -1 (they store nothing); their hidden states are never read, and
  they are garbage (attention leaves their rows unwritten; at capture every row is padding), NaN included: a kernel
  that turns a row's values into addresses must stay in bounds for any values (MoE routing: kernels/moe_route.py);
- sequences past the real B, up to max_seqs: empty (query_start_loc repeats T), so attention gives them no work;
- block tables at their full width; only the real sequences' rows are uploaded.
Attention launches from these shapes alone (`AttentionMetadata.fixed_launch`). The logits stay outside the graph: the
sampling rows are gathered eagerly from the graph's hidden states (their count varies per step).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch
from torch import nn

from orinfer.engine.graph_capture import capture_graph
from orinfer.engine.step_inputs import StepInputs
from orinfer.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

# Steps of more tokens run eagerly: from ~1k tokens the device time of a Qwen3-8B step (>= 20 ms) covers the host's
# launches, and padding to a bucket would only add work.
MAX_GRAPH_TOKENS = 1024
# Mixture-of-experts models read ~3B parameters a token but launch more per layer (routing, alignment, two grouped
# GEMMs, the weighted sum): an eager Qwen3-30B-A3B step costs ~60 ms of host time at any size, against 33 ms of device
# time at 2048 tokens (H200, NOTES run 446: eager 1536- and 2048-token prompts both took 64-66 ms, the 1024-token
# graph 21 ms; prefill 2048 27.4k -> 55.4k tok/s, run 447). Their graphs go as far as the device time of a step could
# cover the host's: ~4k tokens. The hybrid (Gated DeltaNet) MoE models too, since the chunked delta rule no longer
# spills (runs 453-454): Qwen3.5-35B-A3B FP8's 2048-token prompt reaches its first token in 72.6 ms from a graph
# against 80.1 eagerly (runs 456-457; before that kernel's rewrite the graph gained nothing, runs 447 and 450).
MAX_MOE_GRAPH_TOKENS = 4096


def graph_token_limit(num_experts: int, max_num_batched_tokens: int) -> int:
    """The most tokens a step replayed from the mixed-step graphs holds, for a model of `num_experts` routed experts
    a layer (0: dense), under the engine's token budget."""
    return min(MAX_MOE_GRAPH_TOKENS if num_experts > 0 else MAX_GRAPH_TOKENS, max_num_batched_tokens)


def token_buckets(max_tokens: int) -> list[int]:
    """8, 16, 32, 64, 128, then steps of 64 to 512 and of 128 beyond, up to max_tokens: past 128 tokens padding is
    under a third of the bucket. (8: a speculative verify step of a few sequences keeps its linears on the decode
    GEMV, which takes up to 8 rows; at 16 rows they go to cuBLAS.)"""
    buckets = [b for b in (8, 16, 32, 64, 128) if b <= max_tokens]
    buckets += [b for b in range(192, 513, 64) if b <= max_tokens]
    buckets += [b for b in range(640, max_tokens + 1, 128)]
    if not buckets or buckets[-1] < max_tokens:
        buckets.append(max_tokens)
    return buckets


class MixedStepGraphs:
    def __init__(self, model: nn.Module, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, state_scratch_slot: int | None = None,
                 keep_linear_inputs: Callable | None = None) -> None:
        """Graphs for steps of up to `max_tokens` rows over up to `max_seqs` sequences of up to `max_blocks_per_seq`
        KV-cache blocks (of `block_size` tokens) each. `state_scratch_slot` (hybrid models): sequences also carry
        their linear-attention state slot and whether they continue it; padding sequences use this slot.
        `keep_linear_inputs`: hybrid models under speculative decoding, captured into every graph
        (`AttentionMetadata.keep_linear_inputs`)."""
        self.keep_linear_inputs = keep_linear_inputs
        self.model, self.device, self.block_size = model, device, block_size
        self.state_scratch_slot = state_scratch_slot
        self.buckets = token_buckets(max_tokens)
        self.max_tokens, self.max_seqs, self.max_blocks = self.buckets[-1], max_seqs, max_blocks_per_seq
        self.tables_at = 4 * max_seqs + 1  # where the block tables start in the int32 buffer
        t, s = self.max_tokens, max_seqs
        # Inputs live in two device buffers (one per dtype), so a step costs two uploads. int64: ids, positions and
        # slots, [3, max_tokens]; int32: query_start_loc [S+1], context lengths [S], state slots [S], whether each
        # continues its state [S] (the last two for hybrid models), block tables [S, W].
        self.dev_i64 = torch.zeros(3, t, dtype=torch.int64, device=device)
        self.dev_i32 = torch.zeros(self.tables_at + s * max_blocks_per_seq, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.dev_i64
        self.query_start_loc = self.dev_i32[:s + 1]
        self.context_lens = self.dev_i32[s + 1:2 * s + 1]
        self.state_slots = self.dev_i32[2 * s + 1:3 * s + 1]
        self.has_initial_state = self.dev_i32[3 * s + 1:4 * s + 1]
        self.block_tables = self.dev_i32[self.tables_at:].view(s, max_blocks_per_seq)
        self.state_slots.fill_(state_scratch_slot or 0)
        self.slot_mapping.fill_(-1)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.pool = None
        # Tensor parallelism (rank 0): see DecodeGraphs.before_replay.
        self.before_replay: Callable[[tuple, list[torch.Tensor]], None] | None = None

    def _forward(self, tokens: int) -> torch.Tensor:
        meta = AttentionMetadata(
            from_start=False, query_start_loc=self.query_start_loc, context_lens=self.context_lens,
            max_query_len=tokens, max_context_len=self.max_blocks * self.block_size,
            slot_mapping=self.slot_mapping[:tokens], block_tables=self.block_tables, fixed_launch=True)
        if self.state_scratch_slot is not None:
            meta.state_slots, meta.has_initial_state = self.state_slots, self.has_initial_state
            meta.keep_linear_inputs = self.keep_linear_inputs
        return self.model(self.input_ids[:tokens], self.positions[:tokens], meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, so that the smaller ones reuse its memory pool. The capture's batch
        is all padding (every sequence empty): what the graph records is the launches, not these values."""
        for tokens in reversed(self.buckets):
            self._forward(tokens)  # warm-up outside the capture: compiles kernels, loads cuBLAS's
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph, pool=self.pool):
                self.hidden[tokens] = self._forward(tokens)
            self.graphs[tokens] = graph
            if self.pool is None:
                self.pool = graph.pool()
        torch.cuda.synchronize(self.device)
        log.info("captured mixed-step CUDA graphs for %s tokens", self.buckets)

    def fits(self, inputs: StepInputs) -> bool:
        return inputs.num_tokens <= self.max_tokens and len(inputs.context_lens) <= self.max_seqs

    def run(self, inputs: StepInputs, device_ids: torch.Tensor | None = None,
            scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Replays the bucket for this step; returns the hidden states [T, H] (a view of the graph's output, valid
        until the next replay of any graph in the pool: read it in stream order before then). `device_ids` [D]: the
        ids of the first D rows, on the device (lookahead decode rows); `scatter` (rows, ids): the ids of those rows,
        on the device (a verify step's drafts)."""
        tokens, seqs = inputs.num_tokens, len(inputs.context_lens)
        bucket = next(b for b in self.buckets if b >= tokens)
        i64 = np.zeros((3, bucket), dtype=np.int64)
        i64[0, :tokens], i64[1, :tokens], i64[2, :tokens] = inputs.ids, inputs.positions, inputs.slots
        i64[2, tokens:] = -1
        s, width = self.max_seqs, self.max_blocks
        i32 = np.zeros(self.tables_at + seqs * width, dtype=np.int32)
        i32[:seqs + 1] = inputs.starts
        i32[seqs + 1:s + 1] = tokens  # padding sequences: empty
        i32[s + 1:s + 1 + seqs] = inputs.context_lens
        if self.state_scratch_slot is not None:  # padding sequences: the scratch slot, starting fresh
            i32[2 * s + 1:3 * s + 1] = self.state_scratch_slot
            i32[2 * s + 1:2 * s + 1 + seqs] = inputs.state_slots
            i32[3 * s + 1:3 * s + 1 + seqs] = inputs.has_initial_state
        tables = i32[self.tables_at:].reshape(seqs, width)
        for row, table in zip(tables, inputs.block_tables):
            row[:len(table)] = table
        # Pinned by the caching host allocator, which keeps each block until its copy has run.
        self.dev_i64[:, :bucket].copy_(torch.from_numpy(i64).pin_memory(), non_blocking=True)
        self.dev_i32[:i32.size].copy_(torch.from_numpy(i32).pin_memory(), non_blocking=True)
        if device_ids is not None:
            self.input_ids[:device_ids.shape[0]].copy_(device_ids)  # queued after the upload, so it wins
        if scatter is not None:
            self.input_ids.index_copy_(0, *scatter)
        key = ("mixed", bucket, i32.size)
        if self.before_replay is not None:
            self.before_replay(key, self.graph_inputs(key))
        self.graphs[bucket].replay()
        return self.hidden[bucket][:tokens]

    def release(self) -> None:
        """Frees every captured graph (see DecodeGraphs.release)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def graph_for(self, key: tuple[str, int, int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of `key` and its hidden states."""
        return self.graphs[key[1]], self.hidden[key[1]]

    def graph_inputs(self, key: tuple[str, int, int]) -> list[torch.Tensor]:
        """The device buffers graph `key` reads (its int32 buffer up to the step's last block table)."""
        return [self.dev_i64, self.dev_i32[:key[2]]]
