"""Parameter values of the XML tool-call format, converted to the types of the tool's JSON schema.

The XML format writes every value as text (the template renders strings as they are and everything else with
`tojson`), so the text is read back by the schema of its parameter:
- `string`: the text verbatim (never parsed: "007" stays "007");
- `integer`, `number`, `boolean`, `null`: parsed (`true`/`false` and `null`/`none` in any case);
- `object`, `array`: JSON, else a Python literal (models sometimes write `{'a': 1}` or `True`);
- a union (`"type": [...]`, anyOf/oneOf) tries its non-string types first, then keeps the text;
- a known parameter without a type: JSON when the text is JSON, else the text;
- a value its type cannot read, and a parameter the schema does not list: the text, so nothing the model wrote is
  lost (the client's own validation then reports it).
"""

from __future__ import annotations

import ast
import json
import logging
import re
from typing import Any

log = logging.getLogger(__name__)

_INTEGER = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_NO_VALUE = object()


def schema_types(schema: dict[str, Any] | None) -> list[str]:
    """The JSON types a parameter schema allows, in its order ([] when it names none)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out += [k for k in schema_types(sub) if k not in out]
    return out


def _structured(text: str, kind: type) -> Any:
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, kind):
            return value
    return _NO_VALUE


def _as_type(text: str, kind: str) -> Any:
    """`text` read as JSON type `kind`, or _NO_VALUE when it is not one."""
    t = text.strip()
    if kind == "integer" and _INTEGER.fullmatch(t):
        return int(t)
    if kind == "number" and _NUMBER.fullmatch(t):
        return int(t) if _INTEGER.fullmatch(t) else float(t)
    if kind == "boolean" and t.lower() in ("true", "false"):
        return t.lower() == "true"
    if kind == "null" and t.lower() in ("null", "none"):
        return None
    if kind == "object":
        return _structured(t, dict)
    if kind == "array":
        return _structured(t, list)
    return _NO_VALUE


def convert_value(text: str, schema: dict[str, Any] | None, known: bool = True) -> Any:
    """The value of one parameter, written as `text`, under its `schema` (`known`: the tool lists the parameter)."""
    if not known:
        return text
    types = schema_types(schema)
    if not types:
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return text
    for kind in types:
        if kind == "string":
            continue
        value = _as_type(text, kind)
        if value is not _NO_VALUE:
            return value
    if "string" not in types:
        log.debug("tool-call parameter %r is not of type %s: kept as text", text[:80], types)
    return text
