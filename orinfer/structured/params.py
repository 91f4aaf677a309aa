"""The structured-output part of a request (vLLM's `structured_outputs`): exactly one kind of constraint.

- json: a JSON schema (dict, or its JSON text); the output is one JSON value matching it.
- json_object: any JSON object.
- regex: the output matches the regular expression (Rust `regex` syntax, as llguidance reads it).
- choice: the output is exactly one of these strings.
- grammar: a grammar in llguidance's Lark syntax, or GBNF (llama.cpp's), which llguidance converts.

Shapes are checked here; whether a schema, regex or grammar is one the library can compile is checked when the
engine compiles it (`grammar.py`), with the library's reason in the error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from orinfer.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_value(cls, value: "StructuredOutputsParams | dict[str, Any] | None") -> "StructuredOutputsParams | None":
        """Accepts the dataclass, a dict of its fields (as the server receives it) or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise RequestError("structured_outputs must be an object with one of the fields " + ", ".join(KINDS))
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise RequestError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; expected one of "
                               + ", ".join(KINDS))
        return cls(**value)

    @property
    def kind(self) -> str:
        """The one constraint that is set (validate() guarantees there is exactly one)."""
        return next(k for k in KINDS if self._is_set(k))

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and value is not False

    def validate(self) -> None:
        """Raises RequestError naming the field at fault."""
        chosen = [k for k in KINDS if self._is_set(k)]
        if len(chosen) != 1:
            raise RequestError("structured_outputs must set exactly one of " + ", ".join(KINDS)
                               + (f" (got {', '.join(chosen)})" if chosen else " (got none)"))
        kind = chosen[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as exc:
                    raise RequestError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                parsed = value
            if not isinstance(parsed, (dict, bool)):
                raise RequestError("structured_outputs.json must be a JSON schema (an object)")
        elif kind == "json_object":
            if value is not True:
                raise RequestError("structured_outputs.json_object must be true")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise RequestError(f"structured_outputs.{kind} must be a non-empty string")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value \
                    or any(not isinstance(c, str) or not c for c in value):
                raise RequestError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(value)

    def cache_key(self) -> str:
        """A canonical text of the constraint: equal constraints share one compiled grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))
