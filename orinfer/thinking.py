"""Where a Qwen3 output stands relative to its <think> block: the rules shared by the server's reasoning parser
(text), the engine's structured outputs and its thinking budget (token ids), kept here once.

The chat prompt sets the start state (`initial_state`): a prompt whose assistant turn already opened `<think>`
starts inside the reasoning; one that already closed it (`enable_thinking=False`) is all content; otherwise the
output decides: it is reasoning only if it opens with `<think>`, up to the first `</think>`; else all content.
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

TURN_START = "<|im_start|>"
THINK_START = "<think>"
THINK_END = "</think>"


class ThinkState(enum.Enum):
    START = "start"          # nothing decided yet: waiting to see whether the output opens with <think>
    THINKING = "thinking"    # inside <think>...
    CONTENT = "content"      # the answer (after </think>, or the output never thought)


def _last(items: str | Sequence[Any], item: Any) -> int:
    """Index of the last occurrence of `item` in `items` (a substring of a string, an element of a list); -1: none."""
    if isinstance(items, str):
        return items.rfind(item)
    for i in range(len(items) - 1, -1, -1):
        if items[i] == item:
            return i
    return -1


def state_after_prompt(prompt: str | Sequence[int], turn_start: Any, think_start: Any, think_end: Any) -> ThinkState:
    """Where the output starts, from the prompt's last turn (text with the tags as strings, or token ids with the
    tags' ids; `turn_start` None: the whole prompt is the turn)."""
    turn = _last(prompt, turn_start) if turn_start is not None else -1
    tail = prompt[turn + 1:] if turn >= 0 else prompt
    opened, closed = _last(tail, think_start), _last(tail, think_end)
    if opened > closed:
        return ThinkState.THINKING
    if closed >= 0:
        return ThinkState.CONTENT
    return ThinkState.START


def initial_state(prompt: str) -> ThinkState:
    """Where the output starts, judged from the rendered prompt's last turn (after the last `<|im_start|>`)."""
    return state_after_prompt(prompt, TURN_START, THINK_START, THINK_END)


def next_state_for_token(state: ThinkState, token: int, start_id: int | None, end_id: int | None) -> ThinkState:
    """The state after one generated token, judged on ids (`<think>` and `</think>` are single tokens in Qwen's
    vocabularies). START: `<think>` opens the reasoning; any other token makes the output content (the engine does
    not skip leading whitespace as the text parser does: under a constraint that whitespace already belongs to the
    answer). THINKING: `</think>` ends it."""
    if state is ThinkState.START:
        return ThinkState.THINKING if token == start_id else ThinkState.CONTENT
    if state is ThinkState.THINKING and token == end_id:
        return ThinkState.CONTENT
    return state
