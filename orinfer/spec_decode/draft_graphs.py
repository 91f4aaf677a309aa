"""CUDA-graph replay of draft-model proposals: the catch-up forward and the k - 1 single-row draft steps of the draft
model in one graph (the layout, padding and replay of spec_decode/proposal_graphs.py).

Without them a proposal (spec_decode/draft_model.py) is a catch-up chunk through the draft runner's mixed-step graph
when the draft lacks tokens (after a fully accepted verify step: the last draft), then an upload and k replays of its
decode graph, a device copy of each replay's argmax, and the host's launches between them. Here it is one upload and
one replay. The catch-up feeds each sequence's unseen tokens up to and including its newest one x_N, whose row's
argmax is the first draft; steps 1 .. k - 1 run each draft at positions N + 1 .. N + k - 1. Drafts and the draft's
KV entries are those of the eager path.

After a verify step the draft lacks at most the last draft (`num_draft_computed` then stops one short of the
newest token only when every draft was accepted), so a sequence's catch-up is 1 or 2 rows: the graphs hold R = 2
rows a sequence (a batch of up to 4 keeps its linears on the decode GEMV, which takes up to 8 rows). Each bucket has
two graphs:
- one row a sequence (after partly accepted verify steps): the first forward is a decode step, whose attention
  splits long contexts over the SMs as the decode graphs' does;
- up to two: the first forward runs the mixed-step padding over 2 B rows (the extend kernel).
Longer catch-ups (a new prompt, a preemption's recompute, steps that did not speculate) first run eagerly up to the
newest token (`needs_eager_catch_up`); batches past the largest bucket, block tables wider than the graphs' and a
draft of another k run the whole proposal eagerly.

A proposal may also be queued right behind the verify step it follows, before the host knows how many drafts that
step accepts (`run_after_verify`, spec_decode/chain.py): a sequence whose newest token x_P verified drafts
d_1..d_k and accepts a of them then feeds two rows, the token at P + a (x_P itself when a = 0, else d_a) and the
token the step emits after the run, at P + a + 1. When a < k the draft already holds the first row's K/V and
rewrites the same entry. The host fills the inputs as for a = 0; `advance_after_verify` then shifts them by the
accepted counts on the device, so the two-row graph of the bucket replays as it is.
"""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
from torch import nn

from orinfer.layers.attention import AttentionMetadata
from orinfer.spec_decode.proposal_graphs import ProposalGraphs, fill_inputs, pick_bucket

# Catch-up rows a sequence in the graphs: the last draft (after a fully accepted verify step) and the newest token.
ROWS_PER_SEQ = 2


def graph_feed(token_ids: list[int], num_draft_computed: int) -> tuple[int, list[int]]:
    """(first position, tokens) a sequence's graph catch-up feeds: the tokens from the first one whose K/V the draft
    lacks through the newest one (always at least the newest: its row samples the first draft)."""
    first = min(num_draft_computed, len(token_ids) - 1)
    return first, token_ids[first:]


def needs_eager_catch_up(num_tokens: int, num_draft_computed: int, max_rows: int) -> bool:
    """Whether a sequence's graph catch-up (`graph_feed`) would be longer than `max_rows` (the graphs' rows a
    sequence): its tokens before the newest then run eagerly first."""
    return num_tokens - min(num_draft_computed, num_tokens - 1) > max_rows


def graph_key(buckets: list[int], feeds: list[list[int]]) -> tuple[int, bool] | None:
    """(batch bucket, whether every sequence feeds one row) of the graph that runs catch-ups `feeds` (of at most
    ROWS_PER_SEQ rows each); None when the batch is larger than every bucket."""
    bucket = pick_bucket(buckets, ROWS_PER_SEQ, len(feeds), sum(map(len, feeds)))
    return None if bucket is None else (bucket, all(len(feed) == 1 for feed in feeds))


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, n] int64 KV slots of `positions` [B, n] int64 in the block tables `tables` [B, W] int32."""
    return tables.gather(1, positions // block_size).to(torch.int64) * block_size + positions % block_size


def advance_after_verify(dev: dict[str, torch.Tensor], batch: int, accepted: torch.Tensor, emitted: torch.Tensor,
                         block_size: int) -> None:
    """Shifts two-row proposal inputs filled for no accepted draft (`fill_inputs` with feeds [x_P, any] from P, in the
    device views `dev`) to the verify step's outcome for the first `batch` sequences: accepted [>= batch] int64 drafts
    accepted, emitted [>= batch, k + 1] int64 the tokens the step emits (the accepted drafts, then one more). Row 0
    of sequence j takes the token at P_j + a_j, row 1 emitted[j, a_j]; every position, context length and KV slot
    moves by a_j. About 20 small device operations, queued (no host sync)."""
    a = accepted[:batch]
    tokens = emitted[:batch]
    rows = dev["positions"][:2 * batch].view(batch, 2)
    rows += a[:, None]
    ids = dev["ids"][:2 * batch].view(batch, 2)
    last_accepted = tokens.gather(1, (a - 1).clamp(min=0)[:, None]).squeeze(1)
    ids[:, 0] = torch.where(a > 0, last_accepted, ids[:, 0])
    ids[:, 1] = tokens.gather(1, a[:, None]).squeeze(1)
    tables = dev["block_tables"][:batch]
    dev["slots"][:2 * batch].view(batch, 2).copy_(_slots(tables, rows, block_size))
    shift = a.to(torch.int32)
    dev["context_lens"][:batch] += shift
    if dev["step_positions"].shape[0]:  # (k = 1: no single-row steps)
        steps = dev["step_positions"][:, :batch]
        steps += a
        dev["step_context_lens"][:, :batch] += shift
        dev["step_slots"][:, :batch].copy_(_slots(tables, steps.t(), block_size).t())


class DraftGraphs(ProposalGraphs):
    """The draft model's proposal (catch-up, k - 1 single-row steps, their logits and argmaxes), two graphs per batch
    bucket, keyed (bucket, one row a sequence)."""

    name = "draft-model"

    def __init__(self, model: nn.Module, k: int, max_batch: int, max_blocks: int, block_size: int,
                 device: torch.device, argmax: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 capture_scope: Callable[[torch.device, bool], ContextManager] | None = None) -> None:
        """As `ProposalGraphs`; `model`: the draft model (forward and `compute_logits`, its KV pools bound).
        `capture_scope`: the backend's decode-graph scope (`GraphHooks.capture_scope`: L2 prefetch of the weights,
        as its decode graphs have)."""
        super().__init__(k, max_batch, max_blocks, block_size, ROWS_PER_SEQ, device, argmax)
        self.model = model
        self.capture_scope = capture_scope

    def key_for(self, feeds: list[list[int]], widest_table: int) -> tuple[int, bool] | None:
        """The graph that runs catch-ups `feeds` (`graph_key`) for block tables at most `widest_table` wide; None:
        the proposal runs eagerly."""
        return None if widest_table > self.max_blocks else graph_key(self.buckets, feeds)

    def run_after_verify(self, key: tuple[int, bool], tables: list[list[int]], newest: list[int],
                         positions: list[int], accepted: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
        """Drafts [B, k] on the device, as `run`, for B sequences whose verify step is still in flight: sequence j's
        newest token before it is newest[j] at positions[j]; `accepted` [>= B] and `emitted` [>= B, k + 1] are the
        step's outputs on the device (`advance_after_verify`). `key`: a two-row graph (`key_for` of two-row feeds).
        The tables must already hold the blocks of positions up to positions[j] + 2 k."""
        feeds = [[token, 0] for token in newest]  # (row 1's id is set on the device)
        return self.run(key, tables, feeds, positions, before_replay=lambda rows: advance_after_verify(
            self.dev, len(tables), accepted, emitted, self.block_size))

    def graph_keys(self) -> list[tuple[int, bool]]:
        return [(bucket, one_row) for bucket in reversed(self.buckets) for one_row in (False, True)]

    def bucket_of(self, key: tuple[int, bool]) -> int:
        return key[0]

    def _fill(self, key: tuple[int, bool], tables: list[list[int]], feeds: list[list[int]], firsts: list[int]) -> int:
        bucket, one_row = key
        rows = fill_inputs(self.host, bucket, self.k, tables, feeds, firsts, self.block_size)
        if one_row:  # padding sequences of a decode step attend over one slot of block 0
            self.host["context_lens"][len(tables):bucket] = 1
        return rows

    def first_step_meta(self, bucket: int) -> AttentionMetadata:
        """The one-row graphs' first forward: a decode step over the catch-up rows (one a sequence)."""
        d = self.dev
        return AttentionMetadata(
            from_start=False, query_start_loc=self.decode_starts[:bucket + 1], context_lens=d["context_lens"][:bucket],
            max_query_len=1, max_context_len=self.max_blocks * self.block_size, slot_mapping=d["slots"][:bucket],
            block_tables=d["block_tables"][:bucket])

    def _body(self, key: tuple[int, bool]) -> None:
        bucket, one_row = key
        d, k, model = self.dev, self.k, self.model
        if one_row:
            hidden = model(d["ids"][:bucket], d["positions"][:bucket], self.first_step_meta(bucket))
        else:
            rows = bucket * ROWS_PER_SEQ
            hidden = model(d["ids"][:rows], d["positions"][:rows], self.catch_up_meta(bucket))
            hidden = hidden.index_select(0, d["sample_rows"][:bucket])
        self.argmax(model.compute_logits(hidden), self.drafts[0, :bucket])
        for step in range(1, k):
            hidden = model(self.drafts[step - 1, :bucket], d["step_positions"][step - 1, :bucket],
                           self.step_meta(bucket, step))
            self.argmax(model.compute_logits(hidden), self.drafts[step, :bucket])

    def _scope(self, launch: bool) -> ContextManager:
        if self.capture_scope is None:
            return super()._scope(launch)
        return self.capture_scope(self.device, launch)


def capture_draft_graphs(runner, k: int, max_batch: int) -> DraftGraphs | None:
    """The draft runner `runner`'s proposal graphs for `k` drafts for up to `max_batch` sequences (its max_num_seqs
    at most), captured now; None when the runner replays no decode graphs (CUDA graphs off, a backend without graph
    hooks, the CPU) or the draft is a hybrid model (its linear-attention state would need slots and a rollback)."""
    decode_graphs = getattr(runner, "graphs", None)
    if decode_graphs is None or runner.state.num_slots:
        return None
    hooks = decode_graphs.hooks
    graphs = DraftGraphs(runner.model, k, min(max_batch, runner.config.max_num_seqs), decode_graphs.max_blocks,
                         runner.block_size, runner.device,
                         argmax=lambda logits, out: hooks.argmax_rows(logits, out=out),
                         capture_scope=hooks.capture_scope)
    graphs.capture()
    return graphs
