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
        self._args_key_seen = False          # the first "arguments"/"parameters" key came
        self._args_at = -1                   # where the arguments object starts (-1: none)
        self._args_end = -1                  # where it ends, once complete
        self._args_text: str | None = None   # the arguments when given as a string, or "{}" when absent
        self._sent = 0                       # characters of the arguments handed out
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
        """The arguments text that is final and not handed out yet."""
        full = self._arguments()
        piece = full[self._sent:]
        self._sent = len(full)
        return piece

    def _arguments(self) -> str:
        if self._args_at >= 0:
            if self._args_end >= 0:
                return self._text[self._args_at:self._args_end]
            # Open: up to the last safe place; the containers open since the arguments' `{` are closed when broken.
            # (Between safe places the open containers do not change, so the scanner's stack now is the one there.)
            cut = self._text[self._args_at:self._scan.safe]
            return cut + self._scan.closing(keep=1) if self.broken else cut
        if self._args_text is not None:
            return self._args_text
        return "{}" if self.broken or self.done else ""

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
                self._end_value(self._text[self._value_at:end])

    def _start_value(self, first: str) -> None:
        if self._key == "name" and self.name is None and first != '"':
            self.broken = True                           # a name that is not a string
        elif self._key in ARGUMENT_KEYS and not self._args_key_seen:
            self._args_key_seen = True
            if first == "{":
                self._args_at = self._value_at
            elif first != '"':
                self.broken = True                       # arguments neither an object nor a string

    def _end_value(self, token: str) -> None:
        if self._key == "name" and self.name is None:
            name = json.loads(token).strip()
            if name:
                self.name = name
            else:
                self.broken = True                       # a blank name
        elif self._key in ARGUMENT_KEYS and self._value_at == self._args_at:
            self._args_end = self._value_at + len(token)
        elif self._key in ARGUMENT_KEYS and self._args_at < 0 and self._args_text is None and token[0] == '"':
            self._args_text = object_text(json.loads(token))
            self.broken = self._args_text is None        # a string that does not hold an object

    def _end_object(self) -> None:
        if self.name is None:
            self.broken = True                           # no name
        elif self._args_at < 0 and self._args_text is None:
            self._args_text = "{}"
