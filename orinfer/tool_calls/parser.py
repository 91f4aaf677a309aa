"""The incremental tool-call parser: feed it the generated text in pieces, get back the text outside the calls and
the calls as OpenAI deltas. `parse_tool_calls` runs the same parser over a whole text, so a stream and a
non-streaming answer agree on content, calls and arguments for any split of the text.

Both Qwen formats sit in `<tool_call>...</tool_call>` blocks; the body decides how it is read (a block that starts
with `{` is JSON, with `<function=` XML), so a model that answers in the other format of its family is still
understood. What is held back, and when a call is committed:
- Content: a possible start of `<tool_call>` at the end of a piece (`<tool_`) waits until it is decided, and so does
  trailing whitespace (it is the separator the template writes before a call: dropped if a call follows). The
  whitespace after a call is dropped too. No markup ever reaches the content of a well-formed call.
- JSON body (`{"name": ..., "arguments": {...}}`): read as it arrives by a strict-JSON scanner
  (orinfer/tool_calls/json_call.py, json_scan.py). The call is committed, its name delta sent, as soon as the first
  top-level "name" key has a complete, non-blank string value; then each piece of the arguments goes out once it is
  final. Pieces end only at safe places (after a complete value, after an opening bracket, inside a string value
  between two characters): a number, literal, key or escape is sent whole, and nothing sent is ever taken back.
- The arguments string of a JSON call is the model's own text of the arguments object, verbatim from its `{` to its
  `}`, not a re-serialization. It streams character by character with no re-encoding, it is what Qwen's templates
  render (`tojson`), clients parse it to the same object, and as the non-streaming answer is this same parser over
  the whole text, the fragments join up to exactly its arguments for any split of the text. (A canonical json.dumps
  form would have to hold every number and escape back and still could not match json.loads on duplicate keys.)
  Keys in any order: arguments written before the name are held until the name comes. "parameters" is read like
  "arguments"; the first of the two keys counts. Arguments given as a JSON string holding an object go out whole
  when that string ends (the string's value, less the whitespace around it); no arguments key gives `{}` when the
  object closes. Strict JSON: json.loads' extensions (NaN, raw control characters in strings) break the body, as
  the text reaches clients verbatim.
- A JSON body that breaks (stops being JSON, or is not a call: no name, a name or arguments of the wrong type,
  text after the object, cut off): before its name went out, the block goes to the content verbatim, markup
  included. After, the call is closed: its arguments are what was sent, closed at the last safe place (a `"`, then
  `]`/`}` for the open containers), so they are valid JSON; and the block's text goes to the content too, so no
  text is lost. (vLLM and SGLang re-serialize a partial parse with json.dumps and send the growing prefix, which is
  where fragments that do not join up to the final JSON come from; their non-streaming path returns a malformed
  block as content while the stream already sent a call.) The first `</tool_call>` ends the block, even inside a
  JSON string; a possible start of it is held back, never sent as arguments.
- XML body: the call is committed at `<function=NAME>` (its name delta goes out at once) and each parameter adds a
  fragment when its `</parameter>` arrives, so long arguments stream (a missing `</parameter>` is tolerated: the
  next `<parameter=` or `</function>` on a new line ends the value). A `<function=...>` without a usable name makes
  the block malformed (content, as above). Stray text between parameters is dropped; a missing `</tool_call>` after
  `</function>` is tolerated (what follows is content); several `<function=...>` in one block are several calls.
- End of the text inside a block: a complete JSON call is still a call (the closing tag was cut off), else the body
  broke (above); an XML call keeps its complete parameters (a parameter cut off is dropped) and is closed.
- A call to a function that is not among the tools is still returned as a call: the client learns what the model
  tried (and can answer with an error), instead of getting markup as text.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from orinfer.reasoning import partial_suffix  # the same hold-back rule as the <think> tags
from orinfer.tool_calls.json_call import JsonCallReader
from orinfer.tool_calls.types import ToolCall, ToolCallDelta, join_deltas, new_call_id
from orinfer.tool_calls.values import convert_value

log = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
MAX_NAME_CHARS = 256

# States of the parser.
_TEXT, _BLOCK, _JSON, _BAD, _XML_ARGS, _XML_AFTER = "text", "block", "json", "bad", "xml-args", "xml-after"


def _may_become(text: str, *tags: str) -> bool:
    """Whether `text` is a proper prefix of one of `tags` (more text could complete the tag)."""
    return any(tag.startswith(text) and len(text) < len(tag) for tag in tags)


# What ends a parameter's value: its closing tag, or (models sometimes leave it out) the next parameter or the end of
# the function, which are not consumed. The earliest complete one wins, so any split of the text ends it at the same
# place.
_VALUE_ENDS = ((PARAM_CLOSE, len(PARAM_CLOSE)), ("\n" + PARAM_OPEN, 0), ("\n" + FUNC_CLOSE, 0))


_LONGEST_END = max(len(tag) for tag, _ in _VALUE_ENDS)


def _value_end(text: str, start: int) -> tuple[int, int]:
    """(where the value starting at `start` ends, characters of the terminator to consume), or (-1, 0)."""
    found = [(at, skip) for tag, skip in _VALUE_ENDS if (at := text.find(tag, start)) >= 0]
    return min(found) if found else (-1, 0)


def _lstrip(text: str) -> str:
    return text.lstrip() if text[:1].isspace() else text   # no copy of a long buffer that needs none


@dataclass
class Parsed:
    """What one piece of text completed: content outside the calls and call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: "Parsed") -> "Parsed":
        self.content += other.content
        self.calls += other.calls
        return self


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each tool's parameter properties by function name (for the XML format's value types)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[function["name"]] = props if isinstance(props, dict) else {}
    return out


class ToolCallParser:
    """Feed text pieces in order (`feed`), then `finish`; each call returns the content and call deltas completed.
    Call indices count from 0 in the order the calls start."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self._schemas = tool_schemas(tools)
        self._state = _TEXT
        self._buf = ""             # text not consumed yet
        self._held_ws = ""         # trailing whitespace of the content: dropped if a call follows
        self._skip_ws = False      # just after a call: leading whitespace of the content is dropped
        self._raw = ""             # the raw text of the current block (given back as content if malformed)
        self._body_at = 0          # where the block's body starts in _raw (after <tool_call>)
        self._index = -1           # index of the last call started
        self._nargs = 0            # parameters written so far in the current XML call
        self._xml_name = ""        # the current XML call's function name
        self._scanned = 0          # how far a closing tag was already looked for (long values and blocks stay linear)
        self._json: JsonCallReader | None = None   # the current JSON call's reader
        self._json_fed = 0         # how much of _raw the reader has read
        self._json_open = False    # the current JSON call's name went out
        self.num_calls = 0

    # --- public -----------------------------------------------------------------------------------------------------

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        while self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        """End of the text: releases what was held back, closes a cut-off call (see the module docstring)."""
        out = Parsed()
        if self._state == _TEXT:
            self._content(self._buf, out)
            out.content += self._held_ws
        elif self._state in (_BLOCK, _BAD):
            out.content += self._raw
        elif self._state == _JSON:
            self._read_json(len(self._raw), True, out)
            if self._json.broken:
                out.content += self._raw
        elif self._state == _XML_ARGS:
            self._close_xml(out)
        self._buf, self._held_ws, self._raw, self._state = "", "", "", _TEXT
        return out

    # --- the state machine: one step, True when it should run again ---------------------------------------------------

    def _step(self, out: Parsed) -> bool:
        if self._state == _TEXT:
            return self._step_text(out)
        if self._state in (_BLOCK, _BAD):
            return self._step_block(out)
        if self._state == _JSON:
            return self._step_json(out)
        if self._state == _XML_ARGS:
            return self._step_xml_args(out)
        return self._step_xml_after(out)

    def _step_text(self, out: Parsed) -> bool:
        start = self._buf.find(OPEN)
        if start < 0:
            keep = partial_suffix(self._buf, OPEN)
            self._content(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(self._buf[:start], out)
        # The separator before the call belongs to the block: dropped with it, or given back if it is malformed.
        self._raw, self._held_ws = self._held_ws, ""
        self._body_at = len(self._raw) + len(OPEN)
        self._raw += self._buf[start:]
        self._buf, self._scanned = "", 0
        self._state = _BLOCK
        return True

    def _step_block(self, out: Parsed) -> bool:
        self._raw += self._buf
        self._buf = ""
        body_at = self._body_at
        end = self._raw.find(CLOSE, max(body_at, self._scanned))
        self._scanned = max(body_at, len(self._raw) - len(CLOSE) + 1) if end < 0 else 0
        if self._state == _BLOCK:
            head = self._raw[body_at:end if end >= 0 else len(self._raw)].lstrip()
            if head.startswith(FUNC_OPEN):
                return self._start_xml(self._raw[body_at:].lstrip(), out)
            if head.startswith("{"):
                self._json, self._json_open = JsonCallReader(), False
                self._json_fed = self._raw.index("{", body_at)
                self._state = _JSON
                return True
            if end < 0 and (not head or _may_become(head, FUNC_OPEN)):
                return False
            self._state = _BAD
        if end < 0:
            return False
        self._malformed_block(end, out)
        return True

    def _step_json(self, out: Parsed) -> bool:
        """Reads the body up to the closing tag, or up to what might start it; True once the block ended."""
        self._raw += self._buf
        self._buf = ""
        end = self._raw.find(CLOSE, self._json_fed)   # the text read holds no part of a closing tag
        if end < 0:
            self._read_json(len(self._raw) - partial_suffix(self._raw, CLOSE), False, out)
            if self._json.broken:
                self._state, self._scanned = _BAD, 0   # the block becomes content when it closes
            return False
        self._read_json(end, True, out)
        if self._json.broken:
            self._malformed_block(end, out)
        else:
            self._raw, self._buf, self._state, self._skip_ws = "", self._raw[end + len(CLOSE):], _TEXT, True
        return True

    def _start_xml(self, head: str, out: Parsed) -> bool:
        """`head` starts with `<function=`: commits the call once its name is complete (or marks the block bad)."""
        gt = head.find(">")
        if gt < 0:
            if "\n" in head or len(head) > len(FUNC_OPEN) + MAX_NAME_CHARS:
                self._state = _BAD
                return True
            return False
        written = head[len(FUNC_OPEN):gt]
        name = written.strip()
        if not name or len(name) > MAX_NAME_CHARS or "<" in name or "\n" in written or len(name.split()) > 1:
            self._state = _BAD
            return True
        self._begin_call(name, out)
        self._xml_name = name
        self._buf, self._scanned = head[gt + 1:], 0
        self._raw = ""
        self._state = _XML_ARGS
        return True

    def _step_xml_args(self, out: Parsed) -> bool:
        s = _lstrip(self._buf)
        if s.startswith(PARAM_OPEN):
            gt = s.find(">")
            end, skip = _value_end(s, max(gt + 1, self._scanned)) if gt >= 0 else (-1, 0)
            if end < 0:
                self._buf = s
                if gt >= 0:   # the value so far holds no terminator, bar one that more text may complete
                    self._scanned = max(gt + 1, len(s) - _LONGEST_END + 1)
                return False
            self._scanned = 0
            name = s[len(PARAM_OPEN):gt].strip()
            value = s[gt + 1:end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            self._add_param(name, value, out)
            self._buf = s[end + skip:]
            return True
        if s.startswith(FUNC_CLOSE) or s.startswith(CLOSE):
            self._close_xml(out)
            closing = FUNC_CLOSE if s.startswith(FUNC_CLOSE) else CLOSE
            self._buf = s[len(closing):]
            self._state = _XML_AFTER if closing == FUNC_CLOSE else _TEXT
            self._skip_ws = closing == CLOSE
            return True
        if not s or _may_become(s, PARAM_OPEN, FUNC_CLOSE, CLOSE):
            self._buf = s
            return False
        nxt = s.find("<", 1)           # stray text inside the call: skipped up to the next tag
        log.debug("skipping stray text in a tool call: %r", s[:nxt if nxt >= 0 else 80])
        self._buf = s[nxt:] if nxt >= 0 else ""
        return nxt >= 0

    def _step_xml_after(self, out: Parsed) -> bool:
        s = _lstrip(self._buf)
        if s.startswith(CLOSE):
            self._buf, self._state, self._skip_ws = s[len(CLOSE):], _TEXT, True
            return True
        if s.startswith(FUNC_OPEN):         # another call in the same block: read like a new block's body
            self._raw, self._body_at, self._buf, self._state = s, 0, "", _BLOCK
            return True
        if not s or _may_become(s, CLOSE, FUNC_OPEN):
            self._buf = s
            return False
        self._buf, self._state, self._skip_ws = s, _TEXT, True   # no </tool_call>: what follows is content
        return True

    # --- helpers ------------------------------------------------------------------------------------------------------

    def _content(self, text: str, out: Parsed) -> None:
        """Adds text outside the calls, holding its trailing whitespace back."""
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        body = text.rstrip()
        if not body:
            self._held_ws += text
            return
        out.content += self._held_ws + body
        self._held_ws = text[len(body):]

    def _begin_call(self, name: str, out: Parsed) -> None:
        self._index += 1
        self.num_calls += 1
        out.calls.append(ToolCallDelta(self._index, new_call_id(), name, ""))

    def _read_json(self, upto: int, ended: bool, out: Parsed) -> None:
        """Feeds the JSON body up to `upto` in _raw (`ended`: that is the end of the body) and sends what it
        completed: the name once it is known, then each final piece of the arguments (their closing if it broke)."""
        reader = self._json
        reader.feed(self._raw[self._json_fed:upto])
        self._json_fed = upto
        if ended:
            reader.end()
        if not self._json_open and reader.name is not None:
            self._begin_call(reader.name, out)
            self._json_open = True
        if self._json_open and (piece := reader.take_arguments()):
            out.calls.append(ToolCallDelta(self._index, arguments=piece))

    def _malformed_block(self, end: int, out: Parsed) -> None:
        """The block closing at `end` in _raw is malformed: its text, markup included, is content."""
        out.content += self._raw[:end + len(CLOSE)]
        self._skip_ws = False
        self._raw, self._buf, self._state = "", self._raw[end + len(CLOSE):], _TEXT

    def _add_param(self, name: str, text: str, out: Parsed) -> None:
        props = self._schemas.get(self._xml_name, {})
        value = convert_value(text, props.get(name), known=name in props)
        piece = ("{" if self._nargs == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": " \
            + json.dumps(value, ensure_ascii=False)
        self._nargs += 1
        out.calls.append(ToolCallDelta(self._index, arguments=piece))

    def _close_xml(self, out: Parsed) -> None:
        out.calls.append(ToolCallDelta(self._index, arguments="}" if self._nargs else "{}"))
        self._nargs = 0


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
    """Non-streaming: (the content outside the calls, the calls) of a whole generated text."""
    parser = ToolCallParser(tools)
    out = parser.feed(text)
    out += parser.finish()
    return out.content, join_deltas(out.calls)
