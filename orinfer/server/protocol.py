"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are validated strictly as JSON types: a string is not a number, 1.5 is not an integer (1.0 is, as in JSON
Schema), a number is not aboolean, and NaN or Infinity are refused. Fields this server does not use are accepted and ignored, as vLLM does, so
clients written for OpenAI keep working. vLLM's extra sampling fields (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, chat_template_kwargs) are supported.
Ranges that depend on the server's limits (n, max_tokens, stop strings) are checked by the app.

`read_json` (content type, size limit, strict JSON), `validate_body` (one clear 400 message naming the field) and
`messages_for_template` (content parts -> template messages; images refused) turn a request into checked values.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request

I64_MIN, I64_MAX = -(2 ** 63), 2 ** 63 - 1
I32_MAX = 2 ** 31 - 1
TokenId = Annotated[int, Field(ge=0)]


def _integral(value: Any, depth: int = 0) -> Any:
    """JSON Schema counts 1.0 as an integer; strict pydantic does not. Integral floats (also in lists of token ids)
    become ints; float fields accept ints anyway."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 63:
        return int(value)
    if isinstance(value, list) and depth < 2:
        return [_integral(v, depth + 1) for v in value]
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _integral_floats(cls, value: Any) -> Any:
        return _integral(value)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- errors ----------------------------------------------------------------------------------------------------------

class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# --- shared request parts ------------------------------------------------------------------------------------------

class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(_Request):
    """Sampling fields common to both endpoints (vLLM's extras included). None: the model's default."""

    model: str | None = None
    n: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=I32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=I64_MIN, le=I64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0, le=I32_MAX)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


# --- chat ------------------------------------------------------------------------------------------------------------

class ImageURL(_Request):
    url: str
    detail: str | None = None


class ContentPart(_Request):
    """One part of a message's content: {"type": "text", "text": ...}; images and other media are refused by the
    app with a clear message (this engine has no vision encoder yet)."""

    type: Literal["text", "image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "video",
                  "file"]
    text: str | None = None
    image_url: ImageURL | str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template: str | None = None


# --- completions -----------------------------------------------------------------------------------------------------

class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] \
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


# --- reading and checking request bodies -----------------------------------------------------------------------

_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "documents", "bos_token", "eos_token",
                             "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}
_IMAGE_PART_TYPES = {"image_url", "input_image", "image"}
_OTHER_MEDIA = {"input_audio": "audio", "audio_url": "audio", "video_url": "video", "video": "video", "file": "file"}


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


def _check_image(part: Any, param: str) -> None:
    """Refuses an image part: malformed data first (with what is wrong), then any image at all."""
    url = part.image_url.url if part.image_url is not None and not isinstance(part.image_url, str) \
        else part.image_url
    if not url:
        raise APIError(400, f"{param}: an image part needs image_url.url", param=param)
    if url.startswith("data:"):
        header, sep, data = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise APIError(400, f"{param}: an image data URL must be data:<type>;base64,<data>", param=param)
        try:
            if not base64.b64decode(data, validate=True):
                raise ValueError("empty")
        except (binascii.Error, ValueError):
            raise APIError(400, f"{param}: the image data is not valid base64", param=param) from None
    raise APIError(400, "this model does not accept images", param=param, code="image_input_not_supported")


def messages_for_template(messages: list[ChatMessage], limit: int) -> list[dict[str, Any]]:
    if len(messages) > limit:
        raise APIError(400, f"too many messages ({len(messages)}); the limit is {limit}", param="messages")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                param = f"messages.{i}.content.{j}"
                if part.type == "text":
                    if part.text is None:
                        raise APIError(400, f"{param}: a text part needs 'text'", param=param)
                    texts.append(part.text)
                elif part.type in _IMAGE_PART_TYPES:
                    _check_image(part, param)
                elif part.type in _OTHER_MEDIA:
                    raise APIError(400, f"this model does not accept {_OTHER_MEDIA[part.type]} input", param=param)
                else:
                    raise APIError(400, f"{param}: unknown content part type {part.type!r}", param=param)
            content = "\n".join(texts)
        if content is None:
            if m.role != "assistant" or not m.tool_calls:
                raise APIError(400, f"messages.{i}.content is required (role {m.role!r})",
                               param=f"messages.{i}.content")
            content = ""
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        for key in ("name", "reasoning_content", "tool_calls", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


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


# --- responses -------------------------------------------------------------------------------------------------------

class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Response):
    content: list[TokenLogprobEntry] | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = []


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(_Response):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "orinfer"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
