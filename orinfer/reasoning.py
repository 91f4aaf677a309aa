"""Qwen3 thinking: splits generated text into `reasoning_content` (inside <think>...</think>) and `content`.

One incremental parser serves both modes, so a streamed answer joins up to exactly what the non-streaming one
returns. The rules (modern vLLM's `qwen3` parser, made prompt-aware and consistent across modes):

- The chat prompt sets the start state (`orinfer/thinking.py`, shared with the engine's structured outputs). A
  prompt whose assistant turn already opened `<think>` (Qwen3-*-Thinking-2507 templates) starts inside the
  reasoning. A prompt that already closed it (`enable_thinking=False` renders `<think>\\n\\n</think>\\n\\n`) is
  all content: nothing is parsed. Otherwise the output decides.
- Output that starts (after whitespace) with `<think>` is reasoning up to the first `</think>`; what follows is
  content. Output that does not start with `<think>` is all content, verbatim, even if a `</think>` shows up later
  (the model did not think; treating its answer as reasoning is how servers end up with empty answers).
- Newlines around the reasoning and at the start of the answer are dropped, as Qwen's own chat template does
  (`reasoning.strip('\\n')`, `content.lstrip('\\n')`). Empty reasoning (the `/no_think` soft switch makes the model
  emit `<think>\\n\\n</think>`) is reported as no reasoning (null), not as an empty string.
- `</think>` never generated (the budget ran out while thinking): the non-streaming answer returns the whole raw
  output as `content` and no reasoning, as vLLM does, so the answer is never empty. A stream cannot take back what
  it already sent as `reasoning_content`; there the thinking stays reasoning and the finish_reason (usually
  "length") tells the client why no content came.
"""

from __future__ import annotations

from dataclasses import dataclass

# The thinking rules (tags, the prompt's start state) are shared with the engine (structured outputs, the thinking
# budget), so that they and this split agree: orinfer/thinking.py.
from orinfer.thinking import THINK_END, THINK_START, ThinkState, initial_state

__all__ = ["THINK_END", "THINK_START", "ReasoningParser", "Split", "ThinkState", "initial_state", "split_reasoning"]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text that might become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: "Split") -> "Split":
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningParser:
    """Feed text deltas in order; each call returns the reasoning and content they complete (text that might still
    turn into a tag, or trailing newlines of the reasoning, is held back until the next call or `finish`)."""

    def __init__(self, state: ThinkState = ThinkState.START) -> None:
        self.state = state
        self.started_in = state
        self._buf = ""                  # undecided text (START), or a possible partial </think> (THINKING)
        self._reasoning_begun = False   # a non-newline reasoning character was emitted (leading newlines dropped)
        self._held_newlines = ""        # trailing newlines of the reasoning: dropped if </think> follows them
        self._content_begun = False     # after </think>: leading newlines of the answer are dropped
        self._after_think = False       # the content follows a </think> (as opposed to: no thinking at all)
        self.raw = ""                   # everything fed, for the unterminated-thinking fallback

    # --- streaming ---------------------------------------------------------------------------------------------------

    def feed(self, text: str) -> Split:
        self.raw += text
        out = Split()
        self._buf += text
        while True:
            if self.state is ThinkState.START:
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_START):
                    self.state = ThinkState.THINKING
                    self._buf = stripped[len(THINK_START):]
                    continue
                if not stripped or THINK_START.startswith(stripped):
                    return out  # still undecided
                self.state = ThinkState.CONTENT
                continue
            if self.state is ThinkState.THINKING:
                end = self._buf.find(THINK_END)
                if end < 0:
                    keep = partial_suffix(self._buf, THINK_END)
                    out.reasoning += self._reasoning(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                out.reasoning += self._reasoning(self._buf[:end])
                self._held_newlines = ""        # newlines just before </think> are not part of the reasoning
                self._buf = self._buf[end + len(THINK_END):]
                self.state = ThinkState.CONTENT
                self._after_think = True
                continue
            out.content += self._content(self._buf)
            self._buf = ""
            return out

    def finish(self) -> Split:
        """End of the output: releases what was held back."""
        out = Split()
        if self.state is ThinkState.START:
            out.content += self._buf        # only whitespace, or a lone prefix of "<think>": plain content
        elif self.state is ThinkState.THINKING:
            out.reasoning += self._reasoning(self._buf) + self._held_newlines
        else:
            out.content += self._content(self._buf)
        self._buf, self._held_newlines = "", ""
        return out

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_begun:
            text = text.lstrip("\n")
            if not text:
                return ""
            self._reasoning_begun = True
        body = text.rstrip("\n")
        if not body:                        # only newlines: hold them until we know whether </think> follows
            self._held_newlines += text
            return ""
        out = self._held_newlines + body
        self._held_newlines = text[len(body):]
        return out

    def _content(self, text: str) -> str:
        if self._after_think and not self._content_begun:
            text = text.lstrip("\n")
            if not text:
                return ""
            self._content_begun = True
        return text

    @property
    def thinking_unterminated(self) -> bool:
        return self.state is ThinkState.THINKING


def split_reasoning(text: str, state: ThinkState = ThinkState.START) -> tuple[str | None, str]:
    """Non-streaming split: (reasoning or None, content). Unterminated thinking -> (None, the raw output)."""
    parser = ReasoningParser(state)
    out = parser.feed(text)
    unterminated = parser.thinking_unterminated
    out += parser.finish()
    if unterminated:
        return None, text
    return (out.reasoning or None), out.content
