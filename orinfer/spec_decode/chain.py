"""Proposals queued behind the verify step they follow: speculation's counterpart of the engine's lookahead.

A plain decode step can be launched before the host has the previous step's token (engine/in_flight.py). A proposal
could not: which tokens the draft model feeds, at which positions, depends on how many drafts the verify step before
it accepts. So the device idled between a verify step and the next proposal while the host read the tokens,
processed them, scheduled and filled the proposal's inputs: 0.5-0.7 ms of each ~7.5 ms draft-model cycle on the
H200 machine's host (NOTES runs 409-411).

Here the next proposal is queued as soon as the verify step is, reading the accepted counts and tokens where the
step leaves them on the device (spec_decode/draft_graphs.py, `run_after_verify`). For that, every sequence's blocks
first grow to what the proposal after any outcome writes (2 k slots past the newest token), and after the step
`LLMEngine._end_verify` keeps k slots past the sequence's tokens instead of trimming to them. The next
`_propose_drafts` takes the drafts when the same sequences, in the same order, speculate with k drafts each
(`DraftModelProposer.adopt`); otherwise (a sequence finished, was preempted or aborted, a prompt joined the batch, a
sequence nears its max_tokens) it drops them and proposes as before. Queued drafts that are dropped cost device
time, not correctness: the draft's K/V at the positions they wrote is rewritten before it is read, and K/V written
into blocks freed meanwhile is overwritten by their next owner's steps, queued behind. So a proposal is queued only
when the outcome cannot push a sequence past its room for k more drafts, not while prompts wait, and (the engine's
rule) not after a verify step that accepted nothing: drafts that the target keeps rejecting would waste every
queued proposal (0.868x against 0.906x of plain decoding on random weights, NOTES run 418).

Measured (NOTES runs 413-419): Qwen3-8B with an FP8 Qwen3-0.6B drafter, k = 4, forced acceptance 0.8, 1.808x ->
1.838x of plain decoding in one call. The two-row catch-up that such a proposal always runs is what made this pay
only once `fp8_gemv` took two rows (it cost 460 us more than the one-row catch-up before).
"""

from __future__ import annotations

from orinfer.engine.block_manager import BlockManager
from orinfer.engine.in_flight import InFlightStep
from orinfer.engine.sequence import Sequence
from orinfer.spec_decode.verify import DeviceDrafts


class ProposalChain:
    """The proposal queued behind the verify step in flight, if any, and the engine's side of it: which steps get one,
    the blocks it needs, and its hand-over to the next proposal."""

    def __init__(self, block_manager: BlockManager, max_model_len: int, step_budget: int) -> None:
        self.block_manager = block_manager
        self.max_model_len, self.step_budget = max_model_len, step_budget
        self.pending: DeviceDrafts | None = None
        self._held: set[int] = set()  # id() of the sequences of `pending`
        self.num_queued = 0   # proposals queued behind a verify step
        self.num_taken = 0    # of those, the ones the next verify step used

    def queue(self, proposer, drafts: DeviceDrafts | None, step: InFlightStep, prompts_wait: bool) -> None:
        """Right after `step` was launched: when it verifies `drafts` (device drafts, k for each of its sequences,
        exactly its rows) and nothing below rules it out, queues the next proposal behind it
        (`proposer.propose_after_verify`)."""
        self.drop()
        if (drafts is None or prompts_wait or not step.verifies or step.prompt_seqs
                or not hasattr(proposer, "drafts_after_verify") or not proposer.drafts_after_verify(len(drafts.seqs))
                or len(step.seqs) != len(drafts.seqs) or any(a is not b for a, b in zip(step.seqs, drafts.seqs))):
            return
        seqs, k = drafts.seqs, drafts.k
        if len(seqs) * (k + 1) > self.step_budget or not all(self._room_after(seq, k) >= k for seq in seqs):
            return
        bm = self.block_manager
        missing = sum(max(0, seq.blocks_needed(bm.block_size, seq.num_tokens + 2 * k) - len(seq.block_table))
                      for seq in seqs)
        if missing > bm.num_free_blocks:
            return
        for seq in seqs:
            bm.append_slot(seq, 2 * k)
        self.pending = proposer.propose_after_verify(seqs, step.device_accepted, step.device_ids)
        if self.pending is not None:
            self._held = {id(seq) for seq in seqs}
            self.num_queued += 1

    def _room_after(self, seq: Sequence, k: int) -> int:
        """The fewest drafts `seq` may take after a verify step of k drafts, whatever it accepts (it then holds at
        most k + 1 more tokens); 0 under a thinking budget (its room depends on the tokens)."""
        if seq.thinking is not None:
            return 0
        longest = len(seq.token_ids) + k + 1
        return min(seq.params.max_tokens - (longest - seq.num_prompt_tokens) - 1, self.max_model_len - longest - 1)

    def spare_tokens(self, seq: Sequence) -> int:
        """Slots past its tokens that `seq` keeps after the verify step: k while the queued proposal may be taken (its
        K/V writes reach k - 1 past the newest token; the next verify step's, k)."""
        return self.pending.k if self.pending is not None and id(seq) in self._held else 0

    def release(self) -> DeviceDrafts | None:
        """The queued proposal, no longer queued (the caller adopts it or lets it go)."""
        pending = self.pending
        self.drop()
        return pending

    def adopt(self, proposer, drafts: DeviceDrafts | None, seqs: list[Sequence], rooms: list[int]
              ) -> DeviceDrafts | None:
        """`drafts` (a released proposal) as the drafts of `seqs` (with `rooms`) when they fit them
        (`proposer.adopt`); None otherwise."""
        if drafts is None or not seqs:
            return None
        taken = proposer.adopt(drafts, seqs, rooms)
        self.num_taken += taken is not None
        return taken

    def drop(self) -> None:
        """Forgets the queued proposal (its device work stays queued; the next proposal overwrites what it wrote)."""
        self.pending = None
        self._held = set()
