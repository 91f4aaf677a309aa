"""Reads the body of one JSON-format tool call, `{"name": ..., "arguments": {...}}`, as it is generated, so that its
name and arguments can be streamed (the rules are in orinfer/tool_calls/parser.py's docstring).

The arguments are the model's own text of the arguments object, verbatim from its `{` to its `}`: that text streams
as it is generated, and it is valid JSON whenever the body is. The first top-level "arguments" or "parameters" key
gives them (a later one, like any other key, is read and ignored); arguments given as a JSON string that holds an
object are read when that string ends (the arguments are then the string's value, less the whitespace around it);
no such key gives `{}`. A body that breaks (stops being valid JSON, or is not a call) sets `broken`: the arguments
are then closed after the last place the JSON scanner found safe (orinfer/tool_calls/json_scan.py), so what was
handed out plus the closing is valid JSON.
"""

from __future__ import annotations

import json

from orinfer.tool_calls.json_scan import JsonScanner

ARGUMENT_KEYS = ("arguments", "parameters")
_JSON_WS = " \t\n\r"


def object_text(text: str) -> str | None:
    """`text` without the whitespace around it when it is one JSON object (strict JSON), `{}` when it is blank, else
    None."""
    body = text.strip(_JSON_WS)
    if not body:
        return "{}"
    scanner = JsonScanner(report_depth=0)
    scanner.feed(body)
    return body if scanner.done and body[0] == "{" else None


class JsonCallReader:
    """Feed the body from its `{` in pieces (`feed`), then `end` when it ended (closing tag or end of the text).

    `name`: set once the first top-level "name" key's value is a complete, non-blank string. `take_arguments`: the
    arguments text that became final since the last call (called only once `name` is set, it hands out what came
    before at once). `broken`: the body is not a well-formed call; `take_arguments` then closes the arguments.
    `done`: the body is a complete, well-formed call."""

    def __init__(self) -> None:
        self._scan = JsonScanner(report_depth=1)
        self._text = ""
        self._seen = 0                       # scanner events already read
        self._key = ""                       # the current top-level key
        self._value_at = -1                  # where the current top-level value starts
        self._args_at = -1                   # where the first "arguments"/"parameters" value starts (-1: none yet)
        self._args_is_string = False         # that value is a string (read when it ends), not an object
        self._args_end = -1                  # where the arguments object ends, once complete
        self._args_text: str | None = None   # the arguments when not streamed: a string's object, or "{}"
        self._sent = 0                       # characters of the arguments object handed out
        self._all_sent = False               # the arguments were handed out whole (closed, if the body broke)
        self.name: str | None = None
        self.broken = False

    @property
    def done(self) -> bool:
        return self._scan.done and not self.broken

    def feed(self, text: str) -> None:
        if self.broken:
            return
        self._text += text
        self._scan.feed(text)
        self._read_events()
        self.broken = self.broken or self._scan.error

    def end(self) -> None:
        """The body ended: one whose object is not complete is broken."""
        self.broken = self.broken or not self._scan.done

    def take_arguments(self) -> str:
        """The arguments text that is final and not handed out yet (linear: only the new part is copied)."""
        if self._all_sent:
            return ""
        if self._args_at >= 0 and not self._args_is_string:
            # Up to the end of the object, else to the last safe place (then, if the body broke, the containers
            # opened since the arguments' `{` are closed: the open containers at `safe` are the open ones now).
            end = self._args_end if self._args_end >= 0 else self._scan.safe
            piece = self._text[self._args_at + self._sent:end]
            self._sent += len(piece)
            if self._args_end >= 0:
                self._all_sent = True
            elif self.broken:
                piece += self._scan.closing(keep=1)
                self._all_sent = True
            return piece
        if self._args_text is None and (self.broken or self.done):
            self._args_text = "{}"
        self._all_sent = self._args_text is not None
        return self._args_text or ""

    # --- the top-level keys and values ------------------------------------------------------------------------------

    def _read_events(self) -> None:
        events = self._scan.events
        while self._seen < len(events) and not self.broken:
            kind, depth, start, end = events[self._seen]
            self._seen += 1
            if depth == 0:
                if kind == "value-start" and self._text[start] != "{":
                    self.broken = True                   # the body is not an object
                elif kind == "value-end":
                    self._end_object()
            elif kind == "key":
                self._key = json.loads(self._text[start:end])
            elif kind == "value-start":
                self._value_at = start
                self._start_value(self._text[start])
            else:
                self._end_value(end)

    def _start_value(self, first: str) -> None:
        if self._key == "name" and self.name is None and first != '"':
            self.broken = True                           # a name that is not a string
        elif self._key in ARGUMENT_KEYS and self._args_at == -1:   # the first arguments key: its value counts
            if first in '{"':
                self._args_at, self._args_is_string = self._value_at, first == '"'
            else:
                self.broken = True                       # arguments neither an object nor a string

    def _end_value(self, end: int) -> None:
        if self._key == "name" and self.name is None:
            name = json.loads(self._text[self._value_at:end]).strip()
            if name:
                self.name = name
            else:
                self.broken = True                       # a blank name
        elif self._value_at == self._args_at and self._args_is_string:
            self._args_text = object_text(json.loads(self._text[self._value_at:end]))
            self.broken = self._args_text is None        # a string that does not hold an object
        elif self._value_at == self._args_at:
            self._args_end = end

    def _end_object(self) -> None:
        self.broken = self.broken or self.name is None   # no name
