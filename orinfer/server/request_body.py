"""Reading a request body: content type, size limit and strict JSON (`read_json`), validation against a pydantic
model with one clear 400 naming the field (`validate_body`), and the checked `chat_template_kwargs`."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from orinfer.server.errors import APIError

_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "documents", "bos_token", "eos_token",
                             "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> Any:
    ctype = request.headers.get("content-type")
    if ctype is not None:
        media = ctype.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(415, f"the request body must be JSON (Content-Type: application/json), not {media!r}",
                           code="unsupported_media_type")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, "invalid Content-Length header")
        if int(length) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, "invalid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, NaN/Infinity
        raise APIError(400, f"invalid JSON: {exc}") from None


def validate_body(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # The most specific error wins; a value that fits no member of a union lists what each member wanted.
        errors = [(_field_path(e["loc"]), e["msg"]) for e in exc.errors(include_url=False)]
        depth = max(len(path) for path, _ in errors)
        path = next(path for path, _ in errors if len(path) == depth)
        messages = list(dict.fromkeys(msg for p, msg in errors if p == path))
        param = ".".join(str(p) for p in path) or None
        text = " or ".join(messages[:1] + [m[0].lower() + m[1:] for m in messages[1:]])
        raise APIError(400, f"{param}: {text}" if param else text, param=param) from None
    except RecursionError:
        raise APIError(400, "the request is nested too deeply") from None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic error location without the union-member tags it inserts ('str', 'list[ContentPart]', ...)."""
    return tuple(p for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _UNION_TAGS
                                                          and not p[:1].isupper()))


def template_kwargs(kwargs: dict[str, Any] | None) -> tuple[dict[str, Any], bool | None]:
    kwargs = dict(kwargs or {})
    bad = sorted(k for k in kwargs if k in _RESERVED_TEMPLATE_KWARGS or not k.isidentifier())
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {bad[0]!r}", param="chat_template_kwargs")
    thinking = kwargs.pop("enable_thinking", None)
    if thinking is not None and not isinstance(thinking, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be true or false",
                       param="chat_template_kwargs.enable_thinking")
    return kwargs, thinking
