"""A chat answer split three ways: reasoning (`<think>`), content and tool calls; one incremental parser for streams
(`ChatOutputParser`) and the same parser over a whole text (`parse_chat_output`), for the server and `LLM.chat`.

Tool calls inside the reasoning: the Qwen3.5 family can write a `<tool_call>` block before `</think>` (or end its
turn there, without closing the thinking). A complete call found in the reasoning is returned as a tool call, like
one in the content, and taken out of the reasoning text; an incomplete block there stays reasoning text (a JSON
call whose name already went out is closed as a call too, orinfer/tool_calls/parser.py). Calls are
numbered in the order they start, reasoning first. `max_calls=1` (`parallel_tool_calls: false`) keeps the first
call and drops the others (their markup does not become content either).

The non-streaming split follows the reasoning parser's rule for thinking that never ended (the whole output as
content, no reasoning), except when calls were found in it: then it is split as a stream splits it (the reasoning
as reasoning, the calls as calls), which is what such a turn means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orinfer.reasoning import ReasoningParser, Split, ThinkState, initial_state
from orinfer.tool_calls.parser import Parsed, ToolCallParser
from orinfer.tool_calls.types import ToolCall, ToolCallDelta, join_deltas


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: "ChatDelta") -> "ChatDelta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass
class ChatResult:
    reasoning: str | None
    content: str
    calls: list[ToolCall]


class ChatOutputParser:
    """Feed text pieces (`feed`), then `finish`. `think`: where the output starts (see orinfer/reasoning.py;
    CONTENT: no reasoning split). `parse_calls`: look for tool calls (with `tools` for the XML format's types)."""

    def __init__(self, think: ThinkState, parse_calls: bool, tools: list[dict[str, Any]] | None = None,
                 max_calls: int | None = None) -> None:
        self._reasoning = ReasoningParser(think) if think is not ThinkState.CONTENT else None
        self._calls_in_reasoning = ToolCallParser(tools) if parse_calls and self._reasoning is not None else None
        self._calls_in_content = ToolCallParser(tools) if parse_calls else None
        self._reasoning_done = self._reasoning is None
        self._max_calls = max_calls
        self._index: dict[tuple[int, int], int | None] = {}   # (source, local index) -> index in the answer
        self._kept = 0                                        # calls numbered so far

    @property
    def thinking_unterminated(self) -> bool:
        return self._reasoning is not None and self._reasoning.thinking_unterminated

    def feed(self, text: str) -> ChatDelta:
        split = self._reasoning.feed(text) if self._reasoning is not None else Split(content=text)
        return self._route(split, final=False)

    def finish(self) -> ChatDelta:
        split = self._reasoning.finish() if self._reasoning is not None else Split()
        return self._route(split, final=True)

    def _route(self, split: Split, final: bool) -> ChatDelta:
        out = ChatDelta()
        if self._calls_in_reasoning is None:
            out.reasoning += split.reasoning
        else:
            got = self._calls_in_reasoning.feed(split.reasoning) if split.reasoning else Parsed()
            if not self._reasoning_done and (final or self._reasoning.state is ThinkState.CONTENT):
                got += self._calls_in_reasoning.finish()   # the reasoning ended: release what it held back
                self._reasoning_done = True
            out.reasoning += got.content
            out.calls += self._number(0, got.calls)
        if self._calls_in_content is None:
            out.content += split.content
        else:
            got = self._calls_in_content.feed(split.content) if split.content else Parsed()
            if final:
                got += self._calls_in_content.finish()
            out.content += got.content
            out.calls += self._number(1, got.calls)
        return out

    def _number(self, source: int, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        """The deltas with their index in the answer; those of calls beyond `max_calls` are dropped."""
        kept = []
        for d in deltas:
            key = (source, d.index)
            if key not in self._index:
                keep = self._max_calls is None or self._kept < self._max_calls
                self._index[key] = self._kept if keep else None
                self._kept += keep
            index = self._index[key]
            if index is not None:
                kept.append(ToolCallDelta(index, d.id, d.name, d.arguments))
        return kept


def parse_chat_output(text: str, think: ThinkState, parse_calls: bool, tools: list[dict[str, Any]] | None = None,
                      max_calls: int | None = None) -> ChatResult:
    """Non-streaming: the reasoning (None when there is none), content and calls of a whole answer."""
    parser = ChatOutputParser(think, parse_calls, tools, max_calls)
    out = parser.feed(text)
    unterminated = parser.thinking_unterminated
    out += parser.finish()
    calls = join_deltas(out.calls)
    if unterminated and not calls:
        return ChatResult(None, text, [])
    return ChatResult(out.reasoning or None, out.content, calls)


def answer_start(tokenizer: Any, prompt: str) -> ThinkState:
    """Where the answer to `prompt` starts (see `initial_state`); CONTENT for a tokenizer without <think> tags."""
    if tokenizer is None or tokenizer.token_to_id("<think>") is None or tokenizer.token_to_id("</think>") is None:
        return ThinkState.CONTENT
    return initial_state(prompt)
