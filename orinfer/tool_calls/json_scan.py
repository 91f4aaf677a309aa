"""An incremental scanner of strict JSON (RFC 8259), for streaming the JSON tool-call format.

Feed it text in pieces; it checks the text character by character and stops at the first character that no valid
JSON text could continue with (`error`). It builds no values: its user takes spans of the text it reports.
- `events`: the keys and values at depth <= `report_depth` (the top-level value is at depth 0, the keys and values
  of a top-level object at depth 1), as (kind, depth, start, end) with kind "key" (the span of the key string,
  quotes included), "value-start" (the value's first character at `start`; `end` is -1) or "value-end" (`end` just
  after its last character; `start` is -1). Positions count the characters fed so far.
- `safe`: the last place at which the text so far can be closed into valid JSON by appending `closing()`: just
  after an opening `{` or `[`, after a complete value, or inside a string value (not a key) between two characters
  (not inside an escape). Between two safe places the text holds a key, a colon, a comma, a number or a literal,
  none of which can be cut (a number is complete only when the character after it arrives). Safe places depend
  on the text only, not on how it was split into pieces, and the open containers at `safe` are the open ones now.

Strict means what Python's `json.loads` accepts minus its extensions: no NaN/Infinity, no raw control characters
in strings, no leading zeros, only the RFC's escapes (a `\\u` escape takes four hex digits; a lone surrogate escape
is accepted, as json.loads accepts it).
"""

from __future__ import annotations

import re

_WS = " \t\n\r"
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')     # string characters that need no attention
_SPACE = re.compile(r"[ \t\n\r]*")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_CLOSER = {"{": "}", "[": "]"}

# States: what the next character may be.
VALUE = "value"                  # a value (at the start, after ':', after ',' in an array)
VALUE_OR_CLOSE = "value-or-]"    # just after '['
KEY_OR_CLOSE = "key-or-}"        # just after '{'
KEY = "key"                      # after ',' in an object
COLON = "colon"
AFTER_VALUE = "after-value"      # ',' or the container's closer
STRING = "string"
ESCAPE = "escape"                # after a backslash in a string
UNICODE = "unicode"              # among the four hex digits of a \u escape
NUMBER = "number"
LITERAL = "literal"
DONE = "done"                    # the top-level value is complete: only whitespace may follow
ERROR = "error"


class JsonScanner:
    """Checks one JSON value fed in pieces (see the module docstring for what it reports)."""

    def __init__(self, report_depth: int = 1) -> None:
        self.report_depth = report_depth
        self.state = VALUE
        self.pos = 0                         # characters fed so far
        self.stack: list[str] = []           # the open containers, '{' or '['
        self.events: list[tuple[str, int, int, int]] = []
        self.safe = 0
        self.safe_in_string = False          # `safe` is inside a string: closing it takes a '"'
        self.error_at = -1                   # the first bad character, or -1
        self._base = 0                       # position of the piece being scanned
        self._in_key = False                 # the string being read is a key
        self._token_start = 0                # where the current string, number or literal starts
        self._hex_left = 0                   # hex digits still due in a \u escape
        self._number = ""                    # the number read so far
        self._literal = ""                   # the literal being read (true, false or null)

    @property
    def error(self) -> bool:
        return self.state == ERROR

    @property
    def done(self) -> bool:
        return self.state == DONE

    def closing(self, keep: int = 0) -> str:
        """What closes the text up to `safe` into valid JSON, leaving the `keep` outermost containers open."""
        return ('"' if self.safe_in_string else "") + "".join(_CLOSER[c] for c in reversed(self.stack[keep:]))

    def feed(self, text: str) -> None:
        self._base = self.pos
        i = 0
        while i < len(text) and self.state != ERROR:
            i = self._step(text, i)
        self.pos = self.error_at if self.state == ERROR else self.pos + len(text)

    def end(self) -> None:
        """The text ended: a number at the very end is complete (the only value that needs a character after it)."""
        if self.state == NUMBER:
            self._end_number(self.pos)

    # --- one step: consumes at least one character of `text` from `i` (except after a number), returns where it
    # stopped ----------------------------------------------------------------------------------------------------------

    def _step(self, text: str, i: int) -> int:
        state, at = self.state, self._base + i
        if state == STRING:
            j = _PLAIN.match(text, i).end()
            if not self._in_key:
                self._safe(self._base + j, True)
            if j == len(text):
                return j
            c = text[j]
            if c == '"':
                self._end_string(self._base + j + 1)
            elif c == "\\":
                self.state = ESCAPE
            else:
                self._fail(self._base + j)         # a raw control character
            return j + 1
        c = text[i]
        if state == ESCAPE:
            if c == "u":
                self.state, self._hex_left = UNICODE, 4
            elif c in _ESCAPES:
                self._back_in_string(at + 1)
            else:
                self._fail(at)
        elif state == UNICODE:
            if c not in _HEX:
                self._fail(at)
            else:
                self._hex_left -= 1
                if self._hex_left == 0:
                    self._back_in_string(at + 1)
        elif state == NUMBER:
            if c not in _NUMBER_CHARS:
                self._end_number(at)
                return i                            # the character after the number is read by the next step
            self._number += c
        elif state == LITERAL:
            if c != self._literal[at - self._token_start]:
                self._fail(at)
            elif at + 1 - self._token_start == len(self._literal):
                self._value_end(at + 1)
        elif c in _WS:
            return _SPACE.match(text, i).end()
        elif state == DONE:
            self._fail(at)
        elif state in (VALUE, VALUE_OR_CLOSE):
            if c == "]" and state == VALUE_OR_CLOSE:
                self._close(c, at)
            else:
                self._value_start(c, at)
        elif state in (KEY, KEY_OR_CLOSE):
            if c == "}" and state == KEY_OR_CLOSE:
                self._close(c, at)
            elif c == '"':
                self.state, self._in_key, self._token_start = STRING, True, at
            else:
                self._fail(at)
        elif state == COLON:
            if c == ":":
                self.state = VALUE
            else:
                self._fail(at)
        elif c == ",":                                  # AFTER_VALUE
            self.state = KEY if self.stack[-1] == "{" else VALUE
        elif c in "}]":
            self._close(c, at)
        else:
            self._fail(at)
        return i + 1

    # --- transitions ------------------------------------------------------------------------------------------------

    def _value_start(self, c: str, at: int) -> None:
        if c in "{[":
            self._event("value-start", at, -1)
            self.stack.append(c)
            self.state = KEY_OR_CLOSE if c == "{" else VALUE_OR_CLOSE
            self._safe(at + 1, False)
        elif c == '"':
            self._event("value-start", at, -1)
            self.state, self._in_key, self._token_start = STRING, False, at
            self._safe(at + 1, True)
        elif c in _LITERALS:
            self._event("value-start", at, -1)
            self.state, self._literal, self._token_start = LITERAL, _LITERALS[c], at
        elif c == "-" or "0" <= c <= "9":
            self._event("value-start", at, -1)
            self.state, self._number, self._token_start = NUMBER, c, at
        else:
            self._fail(at)

    def _end_number(self, end: int) -> None:
        if _NUMBER.match(self._number):
            self._value_end(end)
        else:
            self._fail(end)

    def _end_string(self, end: int) -> None:
        if self._in_key:
            self._event("key", self._token_start, end)
            self.state = COLON
        else:
            self._value_end(end)

    def _back_in_string(self, at: int) -> None:
        self.state = STRING
        if not self._in_key:
            self._safe(at, True)

    def _close(self, c: str, at: int) -> None:
        if _CLOSER[self.stack[-1]] != c:
            self._fail(at)
            return
        self.stack.pop()
        self._value_end(at + 1)

    def _value_end(self, end: int) -> None:
        self._event("value-end", -1, end)
        self.state = AFTER_VALUE if self.stack else DONE
        self._safe(end, False)

    def _safe(self, at: int, in_string: bool) -> None:
        self.safe, self.safe_in_string = at, in_string

    def _event(self, kind: str, start: int, end: int) -> None:
        depth = len(self.stack)
        if depth <= self.report_depth:
            self.events.append((kind, depth, start, end))

    def _fail(self, at: int) -> None:
        self.state, self.error_at = ERROR, at
