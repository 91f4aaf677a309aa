"""One sequence's constraint in the engine: its matcher, where it stands relative to <think>, its token masks.

The grammar applies to the answer only: while the output is inside Qwen3's <think> block the mask allows every token
(and the matcher does not see them); at the start, where the output may still open a <think> block, the mask is the
grammar's plus `<think>` (rules in orinfer/thinking.py). The engine calls `fill_mask` before each sampling of the
sequence (its previous token is on the host by then, see llm_engine.py) and `accept` with each token it processes, in
order. A lookahead step's masks are wanted before the engine processes the previous token (detokenizing, stop
checks): `advance_ahead` gives the matcher that token as soon as it reaches the host, and the `accept` of it later
returns the result then remembered.
Preemption needs nothing here: a recomputed sequence keeps its output tokens, which the matcher has consumed
already, so its next mask is the right one.
Speculative decoding: a constrained sequence speculates while its output is in the answer (`speculates`). Its drafts
are cut where the grammar would refuse one (`valid_drafts`), and the verify step masks each of its rows with the
grammar's state after the drafts before that row (`fill_draft_masks`: the matcher consumes the drafts and rolls
back); the tokens the step emits then reach `accept` in order, as any others.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import llguidance
import torch

from orinfer.thinking import ThinkState, next_state_for_token

log = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask over `vocab_size` ids (bit i%32 of word i//32 is token i)."""
    return (vocab_size + 31) // 32


class SequenceConstraint:
    """`release`: called once this object is gone (the engine drops a sequence's constraint when it finishes or is
    aborted): the compiler's `lease` gives it, to hand the matcher's template to a later sequence."""

    def __init__(self, matcher: llguidance.LLMatcher, think_state: ThinkState = ThinkState.CONTENT,
                 think_start_id: int | None = None, think_end_id: int | None = None,
                 release: Callable[[], None] | None = None) -> None:
        if think_state is not ThinkState.CONTENT and (think_start_id is None or think_end_id is None):
            think_state = ThinkState.CONTENT  # a vocabulary without <think> tokens never thinks
        self.matcher = matcher
        self.think_state = think_state
        self.think_start_id, self.think_end_id = think_start_id, think_end_id
        self.num_consumed = 0  # tokens the matcher accepted (the answer's tokens so far)
        self._ahead: tuple[int, bool] | None = None  # (token, advance's result): taken early, not yet accepted
        if release is not None:
            weakref.finalize(self, release)

    @property
    def is_complete(self) -> bool:
        """The grammar is finished (its end reached with nothing more allowed, or EOS accepted)."""
        return self.think_state is ThinkState.CONTENT and self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    @property
    def uses_grammar_mask(self) -> bool:
        """Whether the next mask is the grammar's (not inside the reasoning, where every token is allowed)."""
        return self.think_state is not ThinkState.THINKING

    def fill_mask(self, row: torch.Tensor, grammar_done: bool = False) -> None:
        """Writes the allowed next tokens into `row`, a contiguous int32 CPU tensor of `bitmask_words` words.
        `grammar_done`: the matcher's mask is in `row` already (`fill_masks`); only the <think> bit is added."""
        if self.think_state is ThinkState.THINKING:
            row.fill_(-1)
            return
        if not grammar_done:
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self.think_state is ThinkState.START:
            word, bit = divmod(self.think_start_id, 32)
            if word < row.numel():
                # int32 words: bit 31 set is a negative value, so OR through a wrapped int.
                value = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
                row[word] = value - (1 << 32) if value >= 1 << 31 else value
            return

    @property
    def speculates(self) -> bool:
        """Whether drafts can be checked against the grammar: the output is in the answer (not in or before the
        reasoning, whose `<think>` / `</think>` the matcher does not see) and no token waits in `advance_ahead`."""
        return self.think_state is ThinkState.CONTENT and self._ahead is None and not self.matcher.is_error()

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts from here (the matcher is left as it was)."""
        return drafts[:self.matcher.validate_tokens(drafts)] if drafts else drafts

    def advance_ahead(self, token: int) -> None:
        """Advances with `token` now, before the engine processes it; its `accept` then returns this result. One
        token at most is ahead (the engine's lookahead is one step)."""
        assert self._ahead is None, "a second token advanced ahead before the first was accepted"
        self._ahead = (token, self.advance(token))

    def accept(self, token: int) -> bool:
        """The engine's in-order call for each generated token: advances (or returns what `advance_ahead` did with
        it); False if the grammar refused it."""
        if self._ahead is None:
            return self.advance(token)
        ahead, ok = self._ahead
        assert ahead == token, f"token {token} accepted, but {ahead} was advanced ahead"
        self._ahead = None
        return ok

    def advance(self, token: int) -> bool:
        """Takes one generated token; False if the grammar refused it (the matcher is then in its error state)."""
        before = self.think_state
        self.think_state = next_state_for_token(before, token, self.think_start_id, self.think_end_id)
        if before is ThinkState.THINKING or self.think_state is ThinkState.THINKING:
            return True  # reasoning tokens (and the </think> that ends them) are not the grammar's
        ok = self.matcher.consume_token(token)
        if ok:
            self.num_consumed += 1
        else:
            log.warning("structured outputs: token %d refused by the grammar: %s", token, self.matcher.get_error())
        return ok


_executor: llguidance.LLExecutor | None = None


def fill_draft_masks(rows: list[tuple[SequenceConstraint, list[int]]], mask: torch.Tensor) -> None:
    """A verify step's masks: row i of `mask` ([len(rows), bitmask_words] contiguous int32, CPU) gets the tokens
    rows[i]'s constraint allows after consuming rows[i]'s drafts (prefixes of `valid_drafts`, one row per prefix
    length, in order, each constraint's rows together, as the verify step lays them out). Each matcher consumes its
    drafts one by one, a mask after each, then rolls them back."""
    start = 0
    while start < len(rows):
        constraint = rows[start][0]
        end = start
        while end < len(rows) and rows[end][0] is constraint:
            end += 1
        consumed: list[int] = []
        for index in range(start, end):
            prefix = rows[index][1]
            if prefix[:len(consumed)] != consumed:
                raise ValueError("a constraint's verify rows must hold growing prefixes of one draft")
            for token in prefix[len(consumed):]:
                if not constraint.matcher.consume_token(token):
                    raise ValueError(f"draft token {token} is refused by the grammar (drafts pass valid_drafts)")
            consumed = list(prefix)
            constraint.fill_mask(mask[index])
        if consumed:
            constraint.matcher.rollback(len(consumed))
        start = end


def fill_masks(constraints: list[SequenceConstraint], mask: torch.Tensor) -> None:
    """Row i of `mask` ([len(constraints), bitmask_words] contiguous int32, CPU) gets constraints[i]'s allowed
    tokens. The grammar masks are computed together on llguidance's thread pool, outside the interpreter lock: one
    at a time, a batch of 64 JSON rows kept the host ~4 ms per step while the device waited (NOTES run 277). Rows
    whose matchers were copied from one template wait for each other there (grammar.py's `lease` spreads them)."""
    global _executor
    rows = [(c.matcher, i) for i, c in enumerate(constraints) if c.uses_grammar_mask]
    parallel = len(rows) > 1
    if parallel:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr(rows, mask.data_ptr(), mask.shape[1] * mask.element_size(), mask.shape[0])
    for row, constraint in zip(mask, constraints):
        constraint.fill_mask(row, grammar_done=parallel and constraint.uses_grammar_mask)
