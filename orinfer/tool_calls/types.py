"""The parsed tool calls: `ToolCall` (one whole call, as a non-streaming answer carries it) and `ToolCallDelta` (one
piece of a call, as a stream carries it), each with its OpenAI form."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any


def new_call_id() -> str:
    """An id in OpenAI's style: `call_` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One function call the model made. `arguments` is a JSON object as a string (what OpenAI clients expect)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of call `index`: the first piece of a call has its `id` and `name` (and empty arguments), the later
    ones a fragment of `arguments`; the fragments of one call join up to its `ToolCall.arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        if self.name is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


def join_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The whole calls that a sequence of deltas describes, in index order."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.name is not None:
            calls[d.index] = ToolCall(d.id or new_call_id(), d.name, d.arguments)
        else:
            calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]
