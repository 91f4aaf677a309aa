"""Draft-model proposals: a small model of the same tokenizer (Qwen3-0.6B for Qwen3-8B) guesses the next k tokens.

The draft model has its own KV cache, indexed by the target's block ids (one block table serves both; the runner plans
both pools from one budget). Per proposal, for each sequence:
  1. catch-up: the tokens before the newest whose K/V the draft does not hold yet (a new prompt, the last draft of a
     fully accepted run, a preemption's recompute) run through the draft as a prompt chunk;
  2. k greedy decode steps from the newest token, on the device; one host sync reads the k drafts.
With CUDA graphs, a proposal whose batch fits a bucket replays both from one graph (spec_decode/draft_graphs.py:
one upload, one replay; a catch-up longer than 2 tokens first runs eagerly up to the newest token). Otherwise
(the CPU, graphs off, more sequences than the largest bucket) the catch-up runs as a chunk, then the k steps as an
upload and k replays of the draft's decode graph, each feeding its own argmax to the next
(`DecodeGraphs.replay_advanced`), or eagerly without graphs.
The drafts are the draft model's argmax, a deterministic proposal, so the verify step's one-hot rule applies: greedy
output is the target's, and sampled output keeps the target's distribution (spec_decode/verify.py). After a verify
step the draft's K/V counts as valid no further than the target's computed tokens (rejected drafts are overwritten
by the next proposal).
"""

from __future__ import annotations

import torch

from orinfer.engine.block_manager import BlockManager
from orinfer.engine.model_runner import ModelRunner
from orinfer.engine.sequence import Sequence
from orinfer.engine.step_inputs import StepInputs
from orinfer.spec_decode.draft_graphs import DraftGraphs, graph_feed, needs_eager_catch_up
from orinfer.spec_decode.verify import DeviceDrafts, host_drafts


def flat_inputs(seqs: list[Sequence], feeds: list[list[int]], firsts: list[int], block_size: int) -> StepInputs:
    """A flat batch feeding each sequence `feeds[i]` from position `firsts[i]` (slots from its block table); every
    sequence samples at its last row."""
    ids, positions, slots, starts, sample_rows = [], [], [], [0], []
    for seq, feed, first in zip(seqs, feeds, firsts):
        end = first + len(feed)
        ids.extend(feed)
        positions.extend(range(first, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(first, end))
        starts.append(len(ids))
        sample_rows.append(len(ids) - 1)
    return StepInputs(ids=ids, positions=positions, slots=slots, starts=starts,
                      context_lens=[first + len(feed) for first, feed in zip(firsts, feeds)],
                      block_tables=[seq.block_table for seq in seqs], sample_rows=sample_rows,
                      from_start=all(first == 0 for first in firsts), state_slots=[-1] * len(seqs),
                      has_initial_state=[first > 0 for first in firsts])


class DraftModelProposer:
    """Greedy drafts from `runner`'s model (a ModelRunner over the draft model, whose pool has the target's blocks)."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, k: int, max_chunk_tokens: int) -> None:
        self.runner, self.block_manager, self.k = runner, block_manager, k
        self.max_chunk_tokens = max_chunk_tokens
        # Proposals replayed from one CUDA graph each (spec_decode/draft_graphs.py), set by the engine when the draft
        # runner replays graphs; None: the catch-up chunk, then the decode steps.
        self.graphs: DraftGraphs | None = None

    def keep_only(self, running) -> None:
        """(Nothing to forget: what the draft holds lives in the sequences' blocks.)"""

    def propose_batch(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Drafts for `seqs` (all tokens known, none pending): k tokens for each whose room is k and whose blocks can
        grow by k slots (they are appended here: the verify step needs them anyway), none for the others."""
        return host_drafts(self.propose_on_device(seqs, rooms), seqs)

    @torch.inference_mode()
    def propose_on_device(self, seqs: list[Sequence], rooms: list[int]) -> DeviceDrafts:
        """`propose_batch`'s drafts left on the device (nothing here waits for the device)."""
        k = self.k
        picked = []
        for seq, room in zip(seqs, rooms):
            if room >= k and self.block_manager.can_append(seq, k):
                self.block_manager.append_slot(seq, k)
                picked.append(seq)
        if not picked:
            return DeviceDrafts([], torch.zeros(0, k, dtype=torch.int64))
        drafts = self._draft(picked)
        for seq in picked:
            seq.num_draft_computed = len(seq.token_ids) + k - 1  # the newest token and the first k - 1 drafts
        return DeviceDrafts(picked, drafts)

    def drafts_after_verify(self, batch: int) -> bool:
        """Whether `propose_after_verify` can run for `batch` sequences (draft graphs of this k hold them)."""
        graphs = self.graphs
        return graphs is not None and graphs.k == self.k and batch <= graphs.buckets[-1]

    @torch.inference_mode()
    def propose_after_verify(self, seqs: list[Sequence], accepted: torch.Tensor, emitted: torch.Tensor
                             ) -> DeviceDrafts | None:
        """The drafts of the proposal after a verify step still in flight (spec_decode/chain.py), queued behind it:
        `seqs` verified k drafts of this proposer each (the step's rows, in order) and their blocks reach 2 k slots
        past the step's newest token; `accepted`, `emitted`: the step's outputs on the device. None when the draft
        graphs cannot run it (no graphs, too many sequences, tables too wide). Nothing here waits for the device, and
        `num_draft_computed` moves only when the engine takes the drafts (`adopt`)."""
        graphs = self.graphs
        if not self.drafts_after_verify(len(seqs)):
            return None
        tables = [seq.block_table for seq in seqs]
        key = graphs.key_for([[0, 0]] * len(seqs), max(map(len, tables)))
        if key is None:
            return None
        drafts = graphs.run_after_verify(key, tables, [seq.token_ids[-1] for seq in seqs],
                                         [len(seq.token_ids) - 1 for seq in seqs], accepted, emitted)
        return DeviceDrafts(list(seqs), drafts)

    def adopt(self, drafts: DeviceDrafts, seqs: list[Sequence], rooms: list[int]) -> DeviceDrafts | None:
        """`drafts` (from `propose_after_verify`) as this proposal's, when they were made for exactly `seqs` and each
        has room for k drafts (its blocks were appended then); None otherwise (the caller proposes anew)."""
        k = self.k
        if len(seqs) != len(drafts.seqs) or any(a is not b for a, b in zip(seqs, drafts.seqs)) or min(rooms) < k:
            return None
        for seq in seqs:  # (no-ops in practice: the blocks were appended before the drafts were queued)
            if not self.block_manager.can_append(seq, k):
                return None
            self.block_manager.append_slot(seq, k)
        for seq in seqs:
            seq.num_draft_computed = len(seq.token_ids) + k - 1
        return drafts

    def _draft(self, seqs: list[Sequence]) -> torch.Tensor:
        """Catch-up and k greedy steps for `seqs`: drafts [B, k] on the device. Replayed from the draft graphs when a
        bucket holds the batch (same k, few enough sequences, tables narrow enough), after an eager catch-up of the
        sequences whose catch-up is too long for a graph; else `_draft_eager`."""
        graphs = self.graphs
        if graphs is not None and graphs.k == self.k:
            tables = [seq.block_table for seq in seqs]
            widest = max(map(len, tables))
            # (A batch that fits at one row a sequence fits once the long catch-ups are done.)
            if graphs.key_for([[0]] * len(seqs), widest) is not None:
                long = [seq for seq in seqs
                        if needs_eager_catch_up(len(seq.token_ids), seq.num_draft_computed, graphs.rows_per_seq)]
                if long:
                    self._catch_up(long)
                firsts, feeds = zip(*(graph_feed(seq.token_ids, seq.num_draft_computed) for seq in seqs))
                return graphs.run(graphs.key_for(list(feeds), widest), tables, list(feeds), list(firsts))
        return self._draft_eager(seqs)

    def _draft_eager(self, seqs: list[Sequence]) -> torch.Tensor:
        """`_draft` without the draft graphs: the catch-up in chunks, then k decode steps."""
        self._catch_up(seqs)
        return self._greedy_steps(seqs)

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Runs the tokens before each sequence's newest one that the draft's cache lacks, in chunks within the step
        budget."""
        while True:
            todo = [seq for seq in seqs if seq.num_draft_computed < len(seq.token_ids) - 1]
            if not todo:
                return
            budget, batch, feeds = self.max_chunk_tokens, [], []
            for seq in todo:
                if budget <= 0:
                    break
                first = seq.num_draft_computed
                feed = seq.token_ids[first:min(len(seq.token_ids) - 1, first + budget)]
                batch.append(seq)
                feeds.append(feed)
                budget -= len(feed)
            inputs = flat_inputs(batch, feeds, [seq.num_draft_computed for seq in batch], self.runner.block_size)
            self.runner.forward_inputs(inputs)
            for seq, feed in zip(batch, feeds):
                seq.num_draft_computed += len(feed)

    def _greedy_steps(self, seqs: list[Sequence]) -> torch.Tensor:
        """k greedy decode steps from each sequence's newest token: drafts [B, k] on the device."""
        k, batch = self.k, len(seqs)
        drafts = torch.empty(batch, k, dtype=torch.int64, device=self.runner.device)
        graphs = self.runner.graphs
        if graphs is not None and batch <= graphs.max_batch:
            graphs.run(seqs)
            drafts[:, 0] = graphs.greedy_ids(batch)
            longest = max(seq.num_tokens for seq in seqs)
            for step in range(1, k):
                graphs.replay_advanced(batch, longest + step)
                drafts[:, step] = graphs.greedy_ids(batch)
            return drafts
        ids = None
        for step in range(k):
            feeds = [[seq.last_token_id] for seq in seqs]  # stand-ins after the first step: `ids` replaces them
            firsts = [len(seq.token_ids) - 1 + step for seq in seqs]
            hidden, rows = self.runner.forward_inputs(flat_inputs(seqs, feeds, firsts, self.runner.block_size), ids)
            ids = self.runner.model.compute_logits(hidden[rows]).argmax(dim=-1)
            drafts[:, step] = ids
        return drafts
