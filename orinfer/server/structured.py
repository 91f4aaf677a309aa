"""The request fields that ask for structured outputs, turned into one StructuredOutputsParams (or None).

Accepted (at most one kind per request, else a 400):
- chat `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or {"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": ...}} (OpenAI's; `strict` is accepted either way: the
  schema is always enforced);
- vLLM's `structured_outputs` object: exactly one of json, json_object, regex, choice, grammar;
- vLLM's legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
Whether the library can compile a schema is decided by the engine when the request is added (a 400 with the
library's reason).
"""

from __future__ import annotations

from typing import Any

from orinfer.errors import RequestError
from orinfer.server.errors import APIError
from orinfer.structured.params import StructuredOutputsParams

LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """The request's constraint (None: none asked for); APIError 400 naming the field at fault."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    extra = getattr(req, "structured_outputs", None)
    if extra is not None:
        if not isinstance(extra, dict):
            raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
        found.append(("structured_outputs", {k: v for k, v in extra.items() if v is not None and v is not False}))
    for field, kind in LEGACY.items():
        value = getattr(req, field, None)
        if value is not None:
            found.append((field, {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"only one kind of structured output per request (got {names})", param=found[1][0])
    field, spec = found[0]
    try:
        return StructuredOutputsParams.from_value(spec)
    except RequestError as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from None


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, dict):
        raise APIError(400, "response_format must be an object", param="response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict):
            raise APIError(400, "response_format json_schema needs a json_schema object", param="response_format")
        schema = body.get("schema", body.get("json_schema"))
        if schema is None:
            raise APIError(400, "response_format.json_schema needs a schema", param="response_format")
        if not isinstance(schema, (dict, bool)):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return {"json": schema}
    raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object or json_schema)",
                   param="response_format")
