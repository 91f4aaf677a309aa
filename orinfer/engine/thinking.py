"""Qwen3 thinking as the engine sees it: where a sequence stands (before, inside or after its <think>...</think>),
and the thinking token budget (SamplingParams.thinking_token_budget, EngineArgs.thinking_token_budget).

The rules are orinfer/thinking.py's, for text and token ids alike (`state_after_prompt`; the server's reasoning split
takes its start state from the same function, on the rendered prompt's text):
- The prompt's last turn (after its last turn marker, `<|im_start|>`) sets the start: a `<think>` opened after any
  `</think>` starts inside the reasoning (Qwen3-*-Thinking-2507 and Qwen3.5+ templates render `<think>\\n`); a closed
  one (`enable_thinking=False` renders `<think>\\n\\n</think>\\n\\n`) starts in the answer; otherwise the output
  decides: it thinks when it opens with `<think>` (after whitespace only), else it is all answer.
- Inside the reasoning every generated token counts against the budget until `</think>`. When the count reaches the
  budget the engine appends the closing text the Qwen3 template writes (`\\n</think>\\n\\n`, tokenized with the model's
  tokenizer) to the sequence as uncomputed tokens: the next step computes them like a short prompt chunk and samples
  the answer's first token after them. They are output tokens: in the text, in the token count, under max_tokens
  (cut where max_tokens ends) and stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence as Seq

from orinfer.thinking import THINK_END, THINK_START, TURN_START, ThinkState, state_after_prompt

__all__ = ["CLOSING_TEXT", "ThinkState", "ThinkTokens", "ThinkingBudget", "state_after_prompt"]

CLOSING_TEXT = "\n</think>\n\n"   # what Qwen3's template writes between the reasoning and the answer


@dataclass(frozen=True)
class ThinkTokens:
    """A tokenizer's thinking tags as ids, and the ids of the closing text."""

    start: int
    end: int
    turn: int | None
    closing: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any) -> "ThinkTokens | None":
        """The tags of `tokenizer` (None: it has no <think> and </think> tokens, the model does not think)."""
        if tokenizer is None:
            return None
        start, end = tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)
        if start is None or end is None:
            return None
        return cls(start, end, tokenizer.token_to_id(TURN_START), tuple(tokenizer.encode(CLOSING_TEXT)))


class ThinkingBudget:
    """One sequence's reasoning tokens against its budget. `observe` each generated token (in order); when
    `exhausted`, the engine appends `tokens.closing` and calls `closed`."""

    def __init__(self, tokens: ThinkTokens, budget: int, prompt_ids: Seq[int]) -> None:
        self.tokens, self.budget = tokens, budget
        self.state = state_after_prompt(prompt_ids, tokens.turn, tokens.start, tokens.end)
        self.count = 0          # tokens generated inside the reasoning so far
        # A stop string ended the closing text that the engine appended at admission: the sequence ends (as "stop")
        # at its first sampled token, whose text is dropped (a sequence cannot end before its first step).
        self.stop_in_closing = False

    def observe(self, token_id: int, output_blank: Callable[[], bool]) -> None:
        """A generated token. `output_blank()`: whether the output so far, this token included, is whitespace only
        (asked before the output has decided whether it thinks)."""
        if self.state is ThinkState.START:
            if token_id == self.tokens.start:
                self.state = ThinkState.THINKING
            elif not output_blank():
                self.state = ThinkState.CONTENT
        elif self.state is ThinkState.THINKING:
            if token_id == self.tokens.end:
                self.state = ThinkState.CONTENT
            else:
                self.count += 1

    @property
    def exhausted(self) -> bool:
        return self.state is ThinkState.THINKING and self.count >= self.budget

    def may_exhaust_with(self, pending: int) -> bool:
        """Whether `pending` tokens not seen yet could bring the sequence to its budget (a lookahead step must not
        sample past it: that token is chosen on the device before the host could close the reasoning)."""
        if self.state is ThinkState.THINKING:
            return self.count + pending >= self.budget
        return self.state is ThinkState.START and pending > 0 and self.budget == 0

    def draft_room(self) -> int:
        """How many drafts a verify step may carry without passing the budget: it emits up to drafts + 1 tokens, and
        the one that reaches the budget must be the step's last (the host writes the closing text right after it).
        Unlimited (a large number) in the answer."""
        if self.state is ThinkState.CONTENT:
            return 1 << 30
        return max(0, self.budget - self.count - 1)

    def closed(self) -> None:
        self.state = ThinkState.CONTENT
