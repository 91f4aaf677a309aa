"""Speculative decoding for hybrid models: the linear-attention state after the last accepted token, not after all.

A verify step runs each speculating sequence's newest token and its k drafts (1 + k rows); the Gated DeltaNet layers
fold every row into the state, but only the first 1 + a (a: accepted drafts) may stay. The design (cheapest found):

1. begin: each speculating sequence j's state (every layer, one copy of the stacked pools) is copied into work slot j
   (`StatePools.num_work_slots` of them, one per sequence that may speculate in a step: SpeculativeConfig.max_batch),
   and the verify step runs its rows on the work slot. The sequence's own slot keeps the state before the step.
2. during the forward, every linear-attention layer hands its conv inputs and gate inputs (`in_proj` outputs except
   the output gate z) to `keep`, which gathers the verify rows into fixed buffers (`AttentionMetadata.
   keep_linear_inputs`; inside the mixed-step CUDA graphs too, with a fixed row count, so every mixed step gathers).
3. finish, right after the verify sampler, on the device (no host sync): each layer advances the sequence's own slot
   over its first 1 + a kept rows (`GatedDeltaNetBlock.advance_state`: the conv, which rebuilds the conv window from
   the inputs, then the recurrent delta rule, in one fused launch a layer on the triton backend:
   `Ops.gated_delta_advance`). The work slot's state is dropped.

Tensor parallelism: every rank holds its shard of the state (its value heads) and of the kept rows (its heads' conv
and gate inputs), and does 1 and 3 on them: rank 0 decides what `begin` copies and keeps (`start`, then the
forward), and hands `start` and `finish` to the workers first (`before_call`, distributed/mirror.py), so every rank
copies, keeps and advances the same slots in the same order; `finish`'s acceptance counts come with it.

Memory (bytes, L linear-attention layers, S = max_batch, R = S (1 + k) rows):
  work slots  S * state_bytes_per_sequence = S * L * (C (K-1) act + Hv Dk Dv 4); Qwen3.5-27B (L = 48, C = 10240,
              Hv = 48, Dk = Dv = 128): 147 MiB a slot, 2.3 GiB at S = 16;
  kept rows   L * R * (C + 2 Hv) * act: 61 MiB at S = 16, k = 3 (bf16).
Traffic per speculating sequence and step: the copy (read and write one state) and the replay (read and write one
state): 4 * 147 MiB at 27B, ~0.12 ms on an H200, against ~11 ms of weights per step. Keeping the state after every
position instead would write k states and hold k slots per sequence.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from torch import nn

from orinfer.config import ModelConfig
from orinfer.engine.graph_capture import capture_graph
from orinfer.engine.scheduler import StepPlan
from orinfer.engine.state_pools import StatePools
from orinfer.layers.attention import AttentionMetadata


class StateRollback:
    def __init__(self, pools: StatePools, model: nn.Module, max_drafts: int, act_dtype: torch.dtype) -> None:
        """Rollback for verify steps of up to `pools.num_work_slots` speculating sequences of up to `max_drafts`
        drafts each."""
        cfg, device = pools.cfg, pools.device
        self.pools, self.layers = pools, model.state_layers()
        self.max_seqs, self.max_drafts = pools.num_work_slots, max_drafts
        self.max_rows = self.max_seqs * (1 + max_drafts)
        # The rows bound every advance is told (the most any sequence keeps), whatever a step's counts: the fused
        # advance compiles one kernel per tile height it derives from the bound (kernels/gated_delta_decode.py's
        # rows_tile), and one bound is one kernel, which `warm_up` compiles at start-up.
        self.max_count = 1 + max_drafts
        self.rows = torch.zeros(self.max_rows, dtype=torch.int64, device=device)  # flat-batch rows to keep
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        # [layers, rows, ...]: one gather reads every layer's kept rows back (`finish`).
        layers = len(self.layers)
        self.mixed = torch.zeros(layers, self.max_rows, cfg.linear_conv_dim, dtype=act_dtype, device=device)
        self.gates = torch.zeros(layers, self.max_rows, 2 * cfg.linear_num_value_heads, dtype=act_dtype,
                                 device=device)
        self._pending: tuple[list[int], list[int], list[int]] | None = None
        # Called with (method name, its arguments) before `start` and `finish` run: tensor parallelism's rank 0 has
        # every worker's rollback run them too, at the same point of its calls (distributed/executor.py).
        self.before_call: Callable[[str, tuple[Any, ...]], None] | None = None
        self.graphs: RollbackGraphs | None = None  # `use_graphs`

    @staticmethod
    def buffer_bytes(cfg: ModelConfig, max_seqs: int, max_drafts: int, act_dtype: torch.dtype) -> int:
        """Bytes of the kept rows' buffers (the work slots are StatePools')."""
        layers = cfg.num_hidden_layers - cfg.num_kv_layers
        elem = torch.empty((), dtype=act_dtype).element_size()
        return layers * max_seqs * (1 + max_drafts) * (cfg.linear_conv_dim + 2 * cfg.linear_num_value_heads) * elem

    def keep(self, layer: nn.Module, mixed: torch.Tensor, gates: torch.Tensor) -> None:
        """`AttentionMetadata.keep_linear_inputs`: gathers rows `self.rows` (clamped to the step's, so stale rows of
        an earlier step stay in bounds) of this layer's conv and gate inputs. Fixed shapes: capturable."""
        i = self._index[id(layer)]
        rows = self.rows.clamp(max=mixed.shape[0] - 1)
        torch.index_select(mixed, 0, rows, out=self.mixed[i])
        torch.index_select(gates, 0, rows, out=self.gates[i])

    def begin(self, plan: StepPlan, sampled_index: dict[int, int]) -> dict[int, int]:
        """Before a verify step's forward: copies each speculating sequence's state into its work slot and sets the
        rows to keep. Returns {plan index: work slot} for the step's state slots. `sampled_index`: plan index ->
        index among the plan's sampling sequences (the sampler's rows)."""
        rows, slots, picked, overrides = [], [], [], {}
        offset = 0
        for index, (seq, num_new) in enumerate(zip(plan.seqs, plan.num_new_tokens)):
            drafts = plan.num_drafts[index]
            if drafts:
                if drafts > self.max_drafts or len(slots) == self.max_seqs:
                    raise RuntimeError(f"a verify step of more than {self.max_seqs} speculating sequences or "
                                       f"{self.max_drafts} drafts: the state rollback was sized for less")
                rows.extend(range(offset + num_new - 1 - drafts, offset + num_new))
                overrides[index] = self.pools.first_work_slot + len(slots)
                slots.append(seq.state_slot)
                picked.append(sampled_index[index])
            offset += num_new
        counts = [plan.num_drafts[i] + 1 for i in overrides]
        self.start(rows, slots, list(overrides.values()), counts, picked)
        return overrides

    def start(self, rows: list[int], slots: list[int], work_slots: list[int], counts: list[int],
              picked: list[int]) -> None:
        """`begin`'s work on the device: the flat-batch `rows` to keep, each speculating sequence's state slot
        slots[j] copied into work_slots[j]; counts[j] (1 + drafts) and picked[j] (its sampler row) kept for
        `finish`. Tensor-parallel workers run it with rank 0's lists."""
        if self.before_call is not None:
            self.before_call("start", (rows, slots, work_slots, counts, picked))
        device = self.rows.device
        self.rows.copy_(_upload(rows + [0] * (self.max_rows - len(rows)), device))
        self.pools.copy_many(slots, work_slots)
        self._pending = (slots, counts, picked)

    def finish(self, num_accepted: torch.Tensor) -> None:
        """After the verify sampler: advances each speculating sequence's own slot over its newest token and its
        accepted drafts (`num_accepted` [sampling sequences] on the device), from the rows kept."""
        if self.before_call is not None:
            self.before_call("finish", (num_accepted,))
        slots, counts, picked = self._pending
        self._pending = None
        if self.graphs is None:
            device = self.rows.device
            offsets = _upload(_starts(counts), device)
            self._advance(offsets, _upload(slots, device), num_accepted.index_select(0, _upload(picked, device)),
                          self.max_count)
            return
        self.graphs.run(slots, counts, picked, num_accepted)

    def _advance(self, offsets: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor, max_count: int) -> None:
        """The device work of `finish` for n speculating sequences: offsets [n] (where sequence j's kept rows start),
        slots [n] (its own state slot), accepted [n] (its accepted drafts). Fixed shapes for a given n, no host
        sync: `RollbackGraphs` captures it."""
        n, device = slots.shape[0], slots.device
        ends = torch.cumsum(1 + accepted, 0)                                                   # [n]
        starts = torch.cat([torch.zeros(1, dtype=ends.dtype, device=device), ends])          # [n+1]
        p = torch.arange(self.max_rows, device=device)
        seq_of = torch.searchsorted(ends, p, right=True).clamp(max=n - 1)
        source = (offsets[seq_of] + p - starts[seq_of]).clamp(0, self.max_rows - 1)         # rows past: padding
        meta = AttentionMetadata(
            from_start=False, query_start_loc=starts.to(torch.int32), context_lens=torch.zeros(n, dtype=torch.int32,
                                                                                               device=device),
            max_query_len=max_count, max_context_len=0, state_slots=slots,
            has_initial_state=torch.ones(n, dtype=torch.bool, device=device))
        mixed, gates = self.mixed.index_select(1, source), self.gates.index_select(1, source)
        for layer, layer_mixed, layer_gates in zip(self.layers, mixed, gates):
            layer.advance_state(layer_mixed, layer_gates, meta)

    def warm_up(self) -> None:
        """Runs `finish`'s device work once for one sequence on the scratch slot (rows as kept: whatever they hold),
        so that its kernels compile at start-up, not in the first verify step (engine/warmup.py)."""
        device = self.rows.device
        one = torch.zeros(1, dtype=torch.int64, device=device)
        self._advance(one, torch.full_like(one, self.pools.scratch_slot), one, self.max_count)

    def use_graphs(self, max_sampled: int) -> None:
        """Replays `finish`'s device work from CUDA graphs (one per number of speculating sequences, captured the
        second time that number occurs) instead of ~2 eager launches per linear-attention layer: at Qwen3.5-27B those
        48 layers cost several ms of host time a verify step while the device waited (benchmarks/NOTES.md, run 301).
        `max_sampled`: the most sampling sequences a step has (the length of `num_accepted`)."""
        self.graphs = RollbackGraphs(self, max_sampled)


class RollbackGraphs:
    """`StateRollback._advance` replayed from CUDA graphs keyed by the number n of speculating sequences.

    Static inputs: the sequences' kept-row offsets, slots and sampler rows (uploaded from the host lists each step)
    and the step's acceptance counts (copied in on the device). The first step with a given n runs eagerly (its
    Triton kernels compile and warm up then), the second captures and every later one replays. All graphs share one
    memory pool: they never run concurrently and keep nothing past a replay."""

    def __init__(self, rollback: StateRollback, max_sampled: int) -> None:
        device = rollback.rows.device
        self.rollback = rollback
        size = rollback.max_seqs
        self.offsets = torch.zeros(size, dtype=torch.int64, device=device)
        self.slots = torch.zeros(size, dtype=torch.int64, device=device)
        self.picked = torch.zeros(size, dtype=torch.int64, device=device)
        self.num_accepted = torch.zeros(max_sampled, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.warm: set[int] = set()
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, slots: list[int], counts: list[int], picked: list[int], num_accepted: torch.Tensor) -> None:
        n = len(slots)
        host = torch.tensor([_starts(counts), slots, picked], dtype=torch.int64).pin_memory()
        staged = host.to(self.slots.device, non_blocking=True)
        self.offsets[:n].copy_(staged[0])
        self.slots[:n].copy_(staged[1])
        self.picked[:n].copy_(staged[2])
        self.num_accepted[:num_accepted.shape[0]].copy_(num_accepted)
        graph = self.graphs.get(n)
        if graph is not None:
            graph.replay()
            return
        if n not in self.warm:
            self.warm.add(n)
            self._body(n)
            return
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, pool=self.pool):
            self._body(n)
        self.graphs[n] = graph
        graph.replay()  # capturing recorded the work without doing it

    def _body(self, n: int) -> None:
        accepted = self.num_accepted.index_select(0, self.picked[:n])
        self.rollback._advance(self.offsets[:n], self.slots[:n], accepted, self.rollback.max_count)

    def release(self) -> None:
        self.graphs.clear()


def _starts(counts: list[int]) -> list[int]:
    """Where each speculating sequence's kept rows start among the packed rows: the running sums before it."""
    return [0, *itertools.accumulate(counts)][:len(counts)]


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
