"""Reading a request body: JSON content type in UTF-8, size limit and strict JSON (`read_json`), validation against a
pydantic model with one clear 400 naming the field (`validate_body`), and the checked `chat_template_kwargs`."""

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


def _check_content_type(ctype: str | None) -> None:
    """A JSON media type is required: a POST without one (or with a form's or text/plain) is what a browser page may
    send cross-origin without a CORS preflight. JSON is UTF-8 (RFC 8259); another declared charset is refused rather
    than read as UTF-8 (and json.loads would guess UTF-16/32 from the bytes: the body is decoded as UTF-8 only)."""
    if ctype is None:
        raise APIError(415, "the request has no Content-Type; send Content-Type: application/json",
                       code="unsupported_media_type")
    media, *params = ctype.split(";")
    media = media.strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), not {media!r}",
                       code="unsupported_media_type")
    for param in params:
        key, _, value = param.partition("=")
        charset = value.strip().strip('"').lower()
        if key.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            raise APIError(415, f"the request body must be UTF-8 JSON, not charset {charset!r}",
                           code="unsupported_media_type")


async def read_json(request: Request, limit: int) -> Any:
    _check_content_type(request.headers.get("content-type"))
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
        text = raw.decode("utf-8-sig")  # a leading BOM is allowed (RFC 8259 lets a parser ignore it)
    except UnicodeDecodeError as exc:
        raise APIError(400, f"invalid JSON: the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, "invalid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity
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
