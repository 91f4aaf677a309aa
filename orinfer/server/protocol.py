"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are validated strictly as JSON types: a string is not a number, 1.5 is not an integer (1.0 is, as in JSON
Schema), a number is not a boolean, and NaN or Infinity are refused. Fields this server does not use are accepted
and ignored, as vLLM does, so clients written for OpenAI keep working. vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output,
chat_template_kwargs, thinking_token_budget, include_reasoning), logit_bias and mm_processor_kwargs (max_pixels) are
supported. Ranges that depend on the server's limits
(n, max_tokens, stop strings, images) are checked by the handlers.

Reading a body is `request_body`'s job; content parts become template messages in `messages`.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

I64_MIN, I64_MAX = -(2 ** 63), 2 ** 63 - 1
I32_MAX = 2 ** 31 - 1
TokenId = Annotated[int, Field(ge=0)]

T = TypeVar("T")
# A list in a request: validation stops at its first invalid item. pydantic would otherwise report every one, and
# formatting a body's worth of errors (a prompt of a million invalid token ids) took a minute.
Items = Annotated[list[T], Field(fail_fast=True)]


def _integral(value: Any, depth: int = 0) -> Any:
    """JSON Schema counts 1.0 as an integer; strict pydantic does not. Integral floats (also in lists of token ids)
    become ints; float fields accept ints anyway."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 63:
        return int(value)
    if isinstance(value, list) and depth < 2:
        # The types present, at C speed: a list of ints (the usual token ids) is returned as it is, without a Python
        # call per item.
        kinds = set(map(type, value))
        if any(issubclass(k, float) or (depth == 0 and issubclass(k, list)) for k in kinds):
            return [_integral(v, depth + 1) for v in value]
    return value


def _finite_number(value: Any) -> bool:
    """Whether strict pydantic takes `value` as a float (an int beyond the float range, or inf, it does not)."""
    return (type(value) is float and math.isfinite(value)) or (type(value) is int and abs(value) <= 1e308)


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
    stop: str | Items[str] | None = None
    stop_token_ids: Items[TokenId] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0, le=I32_MAX)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Structured outputs (vLLM's object and its legacy fields; server/structured.py reads them)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Items[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _first_bad_bias(cls, value: Any) -> Any:
        """Only the first entry that is not a finite number goes on to validation: pydantic has no fail-fast for a
        dict and would report each bad one of a body's worth of them."""
        if isinstance(value, dict):
            for token, bias in value.items():
                if not _finite_number(bias):
                    return {token: bias}
        return value


# --- chat ------------------------------------------------------------------------------------------------------------

class ImageURL(_Request):
    url: str
    detail: str | None = None


class ContentPart(_Request):
    """One part of a message's content: {"type": "text", "text": ...} or {"type": "image_url", "image_url": {"url":
    "data:image/png;base64,..."}} (vision-language models only); audio, video and files are refused with a clear
    message."""

    type: Literal["text", "image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "video",
                  "file"]
    text: str | None = None
    image_url: ImageURL | str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Items[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: Items[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class MMProcessorKwargs(_Request):
    """vLLM's per-request image preprocessing options: `max_pixels` caps the resized size of each image (at most the
    model's preprocessor limit, at least its min_pixels)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    max_pixels: int | None = Field(None, ge=1, le=I64_MAX)


class ChatCompletionRequest(SamplingFields):
    messages: Items[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    tools: Items[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template: str | None = None
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # Reasoning controls: `reasoning_effort` becomes the template variable of that name (templates that read it, as
    # Qwen3.8's, turn it into instructions); `include_reasoning: false` leaves reasoning_content out of the answer;
    # `thinking_token_budget` caps the reasoning tokens (the engine then closes the thinking itself).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    include_reasoning: bool | None = True
    thinking_token_budget: int | None = Field(None, ge=0, le=I32_MAX)


# --- completions -----------------------------------------------------------------------------------------------------

class CompletionRequest(SamplingFields):
    prompt: str | Annotated[Items[str], Field(min_length=1)] | Annotated[Items[TokenId], Field(min_length=1)] \
        | Annotated[Items[Annotated[Items[TokenId], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=0)   # 0: with echo, the prompt (and its logprobs) only, as vLLM allows
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


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


class TokenizeCompletionRequest(_Request):
    """vLLM's POST /tokenize with a prompt: its token ids."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    """vLLM's POST /tokenize with chat messages: the ids of the prompt the chat template renders from them (as
    /v1/chat/completions would; image parts are refused)."""

    model: str | None = None
    messages: Items[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Items[dict[str, Any]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: Items[TokenId]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
