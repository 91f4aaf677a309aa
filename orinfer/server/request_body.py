"""Reading a request body: JSON content type in UTF-8, size limit (`read_body`), strict JSON with a limit on its
number of values (`parse_json`; `json_count` says why), validation against a pydantic model with one clear 400 naming
the field (`validate_body`), all three for a handler in `BodyReader.read`; and the checked `chat_template_kwargs`.

Parsing and validating cost time in proportion to the values of a body, so `BodyReader` does both in a worker thread
unless the body is small, one body at a time: the parser holds the interpreter lock while it runs, but the value
limit bounds how long (a few milliseconds), and the pydantic validators in Python let the event loop in between."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from orinfer.server import json_count
from orinfer.server.errors import APIError

_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "documents", "bos_token", "eos_token",
                             "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}

# A body of at most this many bytes and (by `json_count.count_upper_bound`) values is parsed and validated on the
# event loop: a long prompt string is tens of KB but a dozen values, parsed in well under a millisecond, about what
# the hand-off to a worker thread costs when idle and far less than it cost under a burst of requests (bodies over the
# old 16 KB bound waited 10-14 ms, up to 44, in the one-at-a-time thread slot: NOTES run 356). Any other body goes to a
# worker thread.
SMALL_BODY_BYTES = 256 * 1024
SMALL_BODY_VALUES = 2048

# The pydantic model of a body, or a function choosing it from the parsed body (/tokenize takes two kinds).
BodyModel = type[BaseModel] | Callable[[Any], type[BaseModel]]


# Nesting beyond which the parser gives up (it recurses once per level, up to Python's recursion limit of 1000):
# a body refused for its number of values that also nests this deep gets the parser's own error.
MAX_DEPTH = 900
_NESTED_TOO_DEEPLY = "invalid JSON: nested too deeply"


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


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes, after the Content-Type check; 413 beyond `limit` bytes, 400 for an empty body."""
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
    return raw


def parse_json(raw: bytes, max_values: int) -> Any:
    """`raw` as strict UTF-8 JSON (400 for anything else); 413 for more than `max_values` values, before parsing."""
    excess = json_count.check(raw, max_values, MAX_DEPTH)
    if excess is json_count.Excess.DEPTH:
        raise APIError(400, _NESTED_TOO_DEEPLY)
    if excess is json_count.Excess.VALUES:
        raise APIError(413, f"the request body holds more than {max_values} JSON values (array items and object "
                            "members)", code="request_too_large")
    try:
        text = raw.decode("utf-8-sig")  # a leading BOM is allowed (RFC 8259 lets a parser ignore it)
    except UnicodeDecodeError as exc:
        raise APIError(400, f"invalid JSON: the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, _NESTED_TOO_DEEPLY) from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, an integer of too many digits
        raise APIError(400, f"invalid JSON: {exc}") from None


def parse_request(raw: bytes, model: BodyModel, max_values: int) -> Any:
    """`raw` parsed (`parse_json`) and validated (`validate_body`) as `model`."""
    body = parse_json(raw, max_values)
    return validate_body(model if isinstance(model, type) else model(body), body)


class BodyReader:
    """Reads, parses and validates request bodies for the handlers, under the server's limits: small bodies (in bytes
    and values) on the event loop, the others in worker threads, `max_concurrent` at a time (the interpreter lock lets one run at a
    time anyway, and the default thread pool also tokenizes, renders prompts and decodes images)."""

    def __init__(self, max_bytes: int, max_values: int, max_concurrent: int = 1) -> None:
        self.max_bytes, self.max_values = max_bytes, max_values
        self._slots = asyncio.Semaphore(max_concurrent)

    async def read(self, request: Request, model: BodyModel) -> Any:
        """The body of `request` as a validated `model` (APIError: 4xx)."""
        raw = await read_body(request, self.max_bytes)
        if len(raw) <= SMALL_BODY_BYTES and json_count.count_upper_bound(raw) <= SMALL_BODY_VALUES:
            return parse_request(raw, model, self.max_values)
        async with self._slots:
            return await asyncio.to_thread(parse_request, raw, model, self.max_values)


def validate_body(model: type[BaseModel], body: Any) -> Any:
    """`body` (parsed JSON) validated as `model`; 400 naming the most specific field at fault."""
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
