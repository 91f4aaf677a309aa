"""Where a Qwen3 output stands relative to its <think> block: the rules shared by the server's reasoning parser
(text) and the engine's structured outputs (token ids), kept here once.

The chat prompt sets the start state (`initial_state`): a prompt whose assistant turn already opened `<think>`
starts inside the reasoning; one that already closed it (`enable_thinking=False`) is all content; otherwise the
output decides: it is reasoning only if it opens with `<think>`, up to the first `</think>`; else all content.
"""

from __future__ import annotations

import enum

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkState(enum.Enum):
    START = "start"          # nothing decided yet: waiting to see whether the output opens with <think>
    THINKING = "thinking"    # inside <think>...
    CONTENT = "content"      # the answer (after </think>, or the output never thought)


def initial_state(prompt: str) -> ThinkState:
    """Where the output starts, judged from the rendered prompt's last turn (after the last `<|im_start|>`)."""
    tail = prompt[prompt.rfind("<|im_start|>") + 1:] if "<|im_start|>" in prompt else prompt
    opened, closed = tail.rfind(THINK_START), tail.rfind(THINK_END)
    if opened > closed:
        return ThinkState.THINKING
    if closed >= 0:
        return ThinkState.CONTENT
    return ThinkState.START


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
