"""Continuous batching by token budget: decide, each step, which tokens of which sequences run.

Each sequence knows how many of its tokens are computed (`Sequence.num_computed_tokens`). A step spends a budget of
`max_num_batched_tokens` tokens:
  1. every running sequence that is decoding gets its one token, first (in admission order; always, even when they
     alone exceed the budget);
  2. running sequences part-way through their prompt get the next chunk of it;
  3. waiting sequences are admitted, in arrival order, while the budget, `max_num_seqs` and the free blocks allow;
     a prefix-cache hit counts its cached tokens as computed.
So one step can mix decode rows with prompt chunks, and a long prompt is computed over several steps while the
others keep decoding. Beside decode rows, a chunk also pays for its attention to the context before it (in token
equivalents, `attention_keys_per_token`), so that a step deep into a long prompt does not stall the streams longer
than one at its start. A sequence samples a token only in the step that computes its last uncomputed token. With
chunked prefill off, a prompt is never split: it waits for a step whose remaining budget holds all of it (or, if
it is longer than the whole budget, for a step with no other prompt in it).

An admitted sequence gets blocks for all its current tokens at once; a decode row gets a slot for its newest token.
When the free blocks cannot cover a decode row, the most recently admitted sequence is preempted: its blocks are
released (their full blocks stay findable in the prefix cache, so the recompute is mostly cache hits) and it goes
back to the front of the queue.

`plan_lookahead` serves the engine's lookahead (a step launched while the previous one is still on the device, its
decode rows reading their input ids there): it plans decode rows and prompt chunks like `schedule` but admits and
preempts nothing, declining whenever the plain next step would.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from orinfer.args import EngineArgs
from orinfer.config import ModelConfig
from orinfer.engine.block_manager import BlockManager
from orinfer.engine.sequence import Sequence, SequenceStatus


# The extend-attention kernel's share of the GEMMs' FLOP rate, measured on the H200 (Qwen3-8B, 2016-token chunks beside
# 32 decode rows: steps of 58 ms at 2k context, 102 ms at 15k; NOTES run 255): it turns FLOPs into device time below.
ATTENTION_FLOP_EFFICIENCY = 0.5


def attention_keys_per_token(cfg: ModelConfig) -> float:
    """The context length at which one token's attention (QK and PV over that many keys, all layers) takes as long
    as its projections and MLP: their FLOPs' ratio times ATTENTION_FLOP_EFFICIENCY (~12k keys for Qwen3-8B)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    # The MLP a token runs: an average layer's (in an MoE model, its router, top_k experts and shared expert).
    mlp = sum(cfg.mlp_parameters(index, active=True) for index in range(cfg.num_hidden_layers)) / cfg.num_hidden_layers
    linear = 2 * (cfg.hidden_size * (2 * q + 2 * kv) + mlp)
    attention_per_key = 4 * q
    return linear / attention_per_key * ATTENTION_FLOP_EFFICIENCY


@dataclass
class StepPlan:
    """One step: seqs[i] runs its tokens [num_computed_tokens, num_computed_tokens + num_new_tokens[i]); the last
    num_drafts[i] of them are speculative draft tokens (a verify row: its newest token, then its drafts).

    `sampled` and `is_decode` are read by the engine and the runner for the same step: each is worked out once, at
    its first read after the last `add` (before the launch advances the sequences' counts), and kept."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    _sampled: list[Sequence] | None = field(default=None, repr=False, compare=False)
    _is_decode: bool | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.num_drafts:  # a plan given as lists of sequences and counts verifies no drafts
            self.num_drafts = [0] * len(self.seqs)

    def add(self, seq: Sequence, num_new: int, num_drafts: int = 0) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)
        self.num_drafts.append(num_drafts)
        self._sampled = self._is_decode = None

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, index: int) -> bool:
        """Whether seqs[index] reaches its newest token this step (and so samples the next one)."""
        seq = self.seqs[index]
        return seq.num_computed_tokens + self.num_new_tokens[index] - self.num_drafts[index] == seq.num_tokens

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that sample a token this step, in batch order (row i of the step's samples)."""
        if self._sampled is None:
            self._sampled = [seq for i, seq in enumerate(self.seqs) if self.samples(i)]
        return self._sampled

    @property
    def is_decode(self) -> bool:
        """Every row is a plain decode row (the CUDA-graph path)."""
        if self._is_decode is None:
            self._is_decode = all(seq.is_decoding for seq in self.seqs) and not self.has_drafts
        return self._is_decode

    @property
    def has_drafts(self) -> bool:
        """Some row verifies draft tokens (speculative decoding)."""
        return any(self.num_drafts)


class Scheduler:
    def __init__(self, config: EngineArgs, block_manager: BlockManager, keys_per_token: float | None = None) -> None:
        """`keys_per_token`: the context length at which a token's attention costs the device as much as the rest of
        its forward (`attention_keys_per_token`); None: chunks count their tokens only."""
        self.config = config
        self.block_manager = block_manager
        self.keys_per_token = keys_per_token
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()   # admission order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """The next step's plan (empty when nothing can run). Blocks are allocated and prefix-cache hits counted
        here; the engine advances `num_computed_tokens` when it launches the step."""
        plan = StepPlan()
        # Decode rows always run, even past the budget (a budget under max_num_seqs): a stream never stalls; prompts
        # get what is left.
        decodes = self._schedule_decodes(plan)
        budget = self._continue_prompts(plan, self.config.max_num_batched_tokens - decodes, decodes > 0)
        self._admit(plan, budget, decodes > 0)
        return plan

    def _continue_prompts(self, plan: StepPlan, budget: float, beside_decodes: bool) -> float:
        """Adds the next chunks of running prompts within `budget`; returns what is left of it."""
        for seq in self.running:
            if budget <= 0:
                break
            if seq.num_uncomputed_tokens > 1:
                context = seq.num_computed_tokens
                chunk = self._chunk(seq.num_uncomputed_tokens, budget, len(plan) > 0, context, beside_decodes)
                if chunk == 0:
                    break  # not split (chunking off): later prompts wait behind it, in order
                chunk = self._end_at_snapshot(seq, context, chunk)
                self._plan(plan, seq, chunk)
                budget -= self._cost(chunk, context, beside_decodes)
        return budget

    def _plan(self, plan: StepPlan, seq: Sequence, num_new: int, num_drafts: int = 0) -> None:
        plan.add(seq, num_new, num_drafts)
        # Register the full blocks this step computes at once: a prompt admitted after it, even in this same step (the
        # choices of an n > 1 request), reuses them. Every layer stores its K/V before it attends, and later steps
        # run after this one on the device. (A pending token's id is not known yet: its block registers later.)
        self.block_manager.commit(seq, min(seq.num_computed_tokens + num_new, len(seq.token_ids)))

    def _chunk(self, uncomputed: int, budget: float, prefill_in_plan: bool, context: int = 0,
               beside_decodes: bool = False) -> int:
        """How many of a prompt's `uncomputed` tokens, after `context` computed ones, run this step (0: none)."""
        if self.config.enable_chunked_prefill:
            threshold = self.config.long_prefill_token_threshold
            if beside_decodes and threshold:
                # Streams wait for the whole step: a long prompt beside them goes in smaller chunks, whose cost
                # (attention included, below) stays within the threshold. (Counting tokens only, a chunk deep into a
                # 16k prompt cost as much as 2k tokens at the start: 56-92 ms gaps in the streams, NOTES run 343.)
                budget = min(budget, threshold)
            limit = int(budget)
            if beside_decodes and self.keys_per_token:
                # The chunk's attention to its context counts too: a step beside decoding streams takes about as
                # long deep into a long prompt as at its start (each stream waits for the whole step).
                a, b = self.keys_per_token, 1.0 + context / self.keys_per_token
                limit = min(limit, int(a * (math.sqrt(b * b + 2.0 * budget / a) - b)))
            return min(uncomputed, max(1, limit))
        if uncomputed <= budget or not prefill_in_plan:
            return uncomputed  # whole; a prompt over the full budget runs in a step of its own, not never
        return 0

    def _end_at_snapshot(self, seq: Sequence, start: int, chunk: int) -> int:
        """A chunk from `start` that would run past the sequence's state-snapshot point (hybrid models with prefix
        caching) ends there instead, so the state can be copied out exactly at that point: a prompt pays one more
        step, of fewer than block_size tokens."""
        point = self.block_manager.snapshot_point(seq)
        return point - start if start < point < start + chunk else chunk

    def _cost(self, chunk: int, context: int, beside_decodes: bool) -> float:
        """What a chunk spends of the step budget: its tokens, plus (beside decode rows) its attention to `context`
        and to itself in token equivalents, n * (context + n / 2) / keys_per_token."""
        if not (beside_decodes and self.keys_per_token and self.config.enable_chunked_prefill):
            return chunk
        return chunk + chunk * (context + chunk / 2) / self.keys_per_token

    def _schedule_decodes(self, plan: StepPlan) -> int:
        """Adds every running sequence that decodes (one token each), preempting the most recently admitted ones
        while the free blocks cannot give a decode row the slot of its newest token. Returns the tokens planned."""
        running = list(self.running)
        index = 0
        while index < len(running):
            seq = running[index]
            index += 1
            if seq.num_uncomputed_tokens != 1:
                continue
            drafts = len(seq.draft_token_ids)
            while not self.block_manager.can_append(seq, drafts):
                victim = running.pop()  # never one already planned: those sit before `seq`
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq, drafts)
                self._plan(plan, seq, 1 + drafts, drafts)
        self.running = deque(running)
        return plan.num_tokens

    def _admit(self, plan: StepPlan, budget: float, beside_decodes: bool) -> None:
        prompts_in_plan = any(seq.num_uncomputed_tokens > 1 for seq in plan.seqs)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            cached = self.block_manager.cached_prefix_tokens(seq)
            chunk = self._chunk(seq.num_tokens - cached, budget, prompts_in_plan, cached, beside_decodes)
            if chunk == 0:
                break
            chunk = self._end_at_snapshot(seq, cached, chunk)
            self.block_manager.allocate(seq)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            self._plan(plan, seq, chunk)
            budget -= self._cost(chunk, cached, beside_decodes)
            prompts_in_plan = True

    def plan_lookahead(self, batch: list[Sequence]) -> StepPlan | None:
        """The step to launch while the previous one is still on the device: a decode row for each sequence of
        `batch` (their newest tokens are pending: the running decoders, in order, minus those the engine knows will
        finish), first, then the next chunks of running prompts and, with what is left of the budget, waiting
        sequences admitted as `schedule` admits them (a prompt's tokens are on the host: its chunk needs nothing
        from the step in flight). So a request that arrives while streams decode joins the next step without
        draining the lookahead (a host round trip with the device idle, for every admission of a busy server). None,
        changing nothing, when free blocks cannot give every decode row its slot (a preemption: the plain step
        decides it). (A queue that cannot be admitted now does not stop the lookahead: a sequence that finishes
        when the in-flight step resolves frees room one step later.)"""
        missing = sum(max(0, s.blocks_needed(self.block_manager.block_size) - len(s.block_table)) for s in batch)
        if missing > self.block_manager.num_free_blocks:
            return None
        plan = StepPlan()
        for seq in batch:
            self.block_manager.append_slot(seq)
            plan.add(seq, 1)
            self.block_manager.commit(seq, len(seq.token_ids))  # as `_plan` does: the known tokens, launched
        budget = self._continue_prompts(plan, self.config.max_num_batched_tokens - len(batch), bool(batch))
        self._admit(plan, budget, bool(batch))
        return plan if plan else None

    def extend(self, seq: Sequence) -> None:
        """The engine appended known tokens to a running sequence (a closed reasoning, engine/thinking.py): slots for
        them, which the next steps compute like a prompt chunk; or, when the free blocks cannot hold them, back to the
        queue to be recomputed (what it computed stays in the prefix cache), as a preemption would."""
        if self.block_manager.can_append(seq):
            self.block_manager.append_slot(seq)
            return
        self.running.remove(seq)
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        # The engine schedules only with no step in flight, so every token of a running sequence is known here.
        assert not seq.num_pending, "preempting a sequence whose newest token is still on the device"
        seq.status = SequenceStatus.WAITING
        seq.draft_token_ids = []
        seq.num_draft_computed = 0  # its blocks go: so does the draft model's K/V in them
        seq.num_preemptions += 1
        seq.num_computed_tokens = 0
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its blocks."""
        seq.status = SequenceStatus.FINISHED
        # A token still in flight (lookahead) is dropped. Its step writes KV into the blocks freed here, but any
        # later user of them is queued on the device behind that step, so its writes win.
        seq.num_pending = 0
        seq.draft_token_ids = []
        if seq.mm is not None:
            seq.mm.encoded = None  # finished or aborted inside its prompt: the tower's outputs are not needed
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
