"""What the handlers share: `ServerLimits` (what one request may ask for) and `ServerState` (the model, its limits,
metrics, the engine loop, the image loader, and the checks every endpoint makes before it submits a request)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

from orinfer.engine.sequence import TokenLogprob
from orinfer.errors import OrinferError, RequestError
from orinfer.structured.params import StructuredOutputsParams
from orinfer.multimodal.image_io import DEFAULT_MAX_IMAGE_PIXELS
from orinfer.sampling_params import SamplingParams
from orinfer.server.engine_loop import EngineDeadError, EngineLoop, RequestGroup
from orinfer.server.engine_process import EngineProcess, engine_info
from orinfer.server.errors import APIError, engine_unavailable, request_error
from orinfer.server.images import ImageLoader
from orinfer.server.logprobs import LogprobFormatter
from orinfer.server.metrics import ServerMetrics
from orinfer.server.protocol import I64_MAX, I64_MIN, ChatLogprobs, CompletionLogprobs, SamplingFields
from orinfer.server.request_body import BodyReader
from orinfer.tool_calls import resolve_format


# Sequences a request may ask for (prompts x choices) and still have its sampling params built on the event loop when
# nothing else in them is costly (`ServerState.build_sampling`).
INLINE_SAMPLING_SEQUENCES = 16


@dataclass
class ServerLimits:
    """What one request may ask for. Beyond these the answer is a 4xx, never a slow or crashed server."""

    max_body_bytes: int = 4 * 1024 * 1024    # request body (413 beyond)
    # JSON values in a body (array items and object members; 413 beyond): handling a body costs time per value, up to
    # seconds for a few MB of small ones. None: 65,536, or the context length + 4,096 if that is more (a prompt of
    # token ids as long as the context fits).
    max_body_values: int | None = None
    max_header_bytes: int = 64 * 1024        # request line + headers (uvicorn's h11_max_incomplete_event_size)
    # Host names (without port) requests may name in their Host header; None: any. `orinfer serve` sets the loopback
    # names when it binds a loopback address without an API key: a web page a user visits can then not reach the
    # server through a DNS name rebound to 127.0.0.1 (the browser sends that name as Host).
    allowed_hosts: frozenset[str] | None = None
    # Characters a prompt may have before it is tokenized; None: CHARS_PER_TOKEN_LIMIT x the context length. A prompt
    # that long cannot fit the context, and tokenizing it would occupy a worker for seconds.
    max_prompt_chars: int | None = None
    request_read_timeout_s: float = 30.0     # a request's head and body must arrive within this (slow clients)
    max_connections: int = 1024              # open connections; the one that reaches this gets 503 at once
    max_n: int = 16                          # choices per prompt
    max_tokens: int | None = None            # cap on max_tokens (None: the context length)
    max_prompts: int = 64                    # prompts in one /v1/completions request
    max_sequences: int = 64                  # prompts x n in one request
    max_messages: int = 4096                 # messages in one chat
    max_stop: int = 16                       # stop strings
    max_stop_chars: int = 256                # characters per stop string
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024               # logit_bias entries (each is checked, per choice, and applied per step)
    max_pending_sequences: int = 4096        # sequences in or queued for the engine (429 beyond; 400 for a request
                                             # larger than this alone, which could never be admitted)
    # Images (vision-language models).
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 1024 * 1024  # encoded bytes of one image (its base64 is 4/3 of that)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # decoded pixels of one image, before resizing
    # Decoded pixels of all of one request's images together (before resizing): with max_concurrent_image_decodes it
    # bounds the memory image decoding can take (3 bytes a pixel: 64 Mpx is 192 MiB per request being decoded).
    max_request_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_concurrent_image_decodes: int = 4    # requests decoding images at the same time (bounds their memory)
    allowed_local_media_path: str | None = None  # local image files only below this directory (None: none)

    def __post_init__(self) -> None:
        if self.max_body_values is not None and self.max_body_values <= 0:
            raise ValueError(f"ServerLimits.max_body_values must be positive, got {self.max_body_values}")
        for name in ("max_images_per_request", "max_image_bytes", "max_image_pixels", "max_concurrent_image_decodes",
                     "max_request_image_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ServerLimits.{name} must be positive, got {getattr(self, name)}")


# The default of ServerLimits.max_body_values for models of a short context.
MIN_BODY_VALUES = 65_536

# Natural text averages 1.5-5 characters per token (Chinese to English, code in between): 16 leaves a wide margin.
CHARS_PER_TOKEN_LIMIT = 16


class ServerState:
    """The model, limits, metrics and the engine loop, plus the checks every endpoint makes."""

    def __init__(self, llm: Any, name: str, limits: ServerLimits, reasoning: bool | None,
                 tool_call_parser: str | None = None) -> None:
        """`llm`: an `orinfer.LLM` (its engine runs in a thread of this process) or an `EngineProcess` (the engine in
        a child process)."""
        self.name, self.limits = name, limits
        self.tokenizer = llm.tokenizer
        self.engine = None if isinstance(llm, EngineProcess) else llm.engine  # in this process: tests inspect it
        if isinstance(llm, EngineProcess):
            info, self.loop = llm.info, llm
        else:
            # Images are decoded by the server (ImageLoader, under its limits); the engine must never read a path.
            llm.engine.allow_local_files = False
            info, self.loop = engine_info(llm.engine), EngineLoop(llm.engine)
        self.max_model_len, self.vocab_size, self.multimodal = info.max_model_len, info.vocab_size, info.multimodal
        self.kv_capacity = info.kv_capacity
        self.max_prompt_chars = limits.max_prompt_chars or CHARS_PER_TOKEN_LIMIT * self.max_model_len
        max_values = limits.max_body_values or max(MIN_BODY_VALUES, self.max_model_len + 4096)
        self.bodies = BodyReader(limits.max_body_bytes, max_values)
        self.created = int(time.time())
        self.images = ImageLoader(info.image_processor, limits)
        self.metrics = ServerMetrics(self.loop.stats)
        self.loop.metrics = self.metrics
        has_think = self.tokenizer is not None and self.tokenizer.token_to_id("<think>") is not None \
            and self.tokenizer.token_to_id("</think>") is not None
        self.has_think_tags = has_think
        self.reasoning = has_think if reasoning is None else reasoning
        if tool_call_parser is None:
            tool_call_parser = "auto" if self.engine is None else self.engine.config.tool_call_parser
        template = self.tokenizer.chat_template_for(True) if self.tokenizer is not None else None
        self.tool_format = resolve_format(tool_call_parser, template)  # None: answers are not parsed for calls
        self.logprobs = LogprobFormatter(self.tokenizer)

    # --- checks ---

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def check_common(self, req: SamplingFields, num_prompts: int) -> int:
        n = 1 if req.n is None else req.n
        lim = self.limits
        if n > lim.max_n:
            raise APIError(400, f"n={n} is above this server's limit of {lim.max_n}", param="n")
        if n * num_prompts > lim.max_sequences:
            raise APIError(400, f"{num_prompts} prompts x n={n} is above this server's limit of {lim.max_sequences} "
                                "sequences per request", param="n")
        if n * num_prompts > lim.max_pending_sequences:  # could never be admitted, even by an idle server: not a 429
            raise APIError(400, f"{num_prompts} prompt(s) x n={n} is above this server's limit of "
                                f"{lim.max_pending_sequences} pending sequences (--max-pending)", param="n")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > lim.max_stop:
            raise APIError(400, f"at most {lim.max_stop} stop strings are allowed", param="stop")
        if any(len(s) > lim.max_stop_chars for s in stops):
            raise APIError(400, f"a stop string may have at most {lim.max_stop_chars} characters", param="stop")
        ids = req.stop_token_ids or []
        if len(ids) > lim.max_stop_token_ids or any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"stop_token_ids: at most {lim.max_stop_token_ids} ids in 0..{self.vocab_size - 1}",
                           param="stop_token_ids")
        return n

    def logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias (token id as a string -> bias in [-100, 100]) as the engine takes it."""
        if not bias:
            return None
        if len(bias) > self.limits.max_logit_bias:
            raise APIError(400, f"logit_bias: at most {self.limits.max_logit_bias} entries are allowed",
                           param="logit_bias")
        out = {}
        for key, value in bias.items():
            token = int(key) if key.isascii() and key.isdigit() and len(key) < 20 else -1
            if not 0 <= token < self.vocab_size:
                raise APIError(400, f"logit_bias: {key!r} is not a token id in 0..{self.vocab_size - 1}",
                               param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise APIError(400, f"logit_bias: the bias of token {key} is {value}; it must be in [-100, 100]",
                               param="logit_bias")
            out[token] = out.get(token, 0.0) + float(value)
        return out

    def check_prompt(self, ids: list[int], param: str, length: int | None = None) -> None:
        """`length`: the prompt's length in the engine when it differs from len(ids) (images' visual tokens)."""
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        length = len(ids) if length is None else length
        if length >= self.max_model_len:
            raise APIError(400, f"the prompt has {length} tokens; this model's context length is "
                                f"{self.max_model_len} tokens, which leaves no room to generate", param=param,
                           code="context_length_exceeded")

    def max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        room = self.max_model_len - prompt_len
        cap = self.limits.max_tokens
        if requested is None:  # up to the context, but never more than the KV cache could ever hold
            room = max(1, min(room, self.kv_capacity - prompt_len))
            return room if cap is None else min(room, cap)
        if cap is not None and requested > cap:
            raise APIError(400, f"{param}={requested} is above this server's limit of {cap}", param=param)
        if requested > room:
            raise APIError(400, f"the prompt ({prompt_len} tokens) + {param} ({requested}) exceeds this model's "
                                f"context length of {self.max_model_len} tokens", param=param,
                           code="context_length_exceeded")
        return requested

    def sampling(self, req: SamplingFields, max_tokens: int, choice: int, logprobs: int | None, *,
                 prompt_logprobs: int | None = None, thinking_token_budget: int | None = None,
                 structured_outputs: StructuredOutputsParams | None = None,
                 think_state: str | None = None) -> SamplingParams:
        """`structured_outputs`: the request's constraint (server/structured.py); `think_state`: where the output
        starts relative to <think> (chat), so that the constraint applies to the answer only."""
        if thinking_token_budget is not None and not self.has_think_tags:
            raise APIError(400, "thinking_token_budget: this model has no <think> tokens", param="thinking_token_budget")
        seed = req.seed
        if seed is not None and choice:
            seed += choice                       # choice i of a seeded request uses seed + i (wrapping in int64)
            if seed > I64_MAX:
                seed += I64_MIN * 2
        if req.min_tokens and req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({req.min_tokens}) is above max_tokens ({max_tokens})",
                           param="min_tokens")
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                seed=seed, stop=req.stop, stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=bool(req.ignore_eos), min_tokens=req.min_tokens or 0,
                skip_special_tokens=req.skip_special_tokens is not False,
                include_stop_str_in_output=bool(req.include_stop_str_in_output), logprobs=logprobs,
                logit_bias=self.logit_bias(req.logit_bias), prompt_logprobs=prompt_logprobs,
                thinking_token_budget=thinking_token_budget, structured_outputs=structured_outputs,
                think_state=think_state)
        except RequestError as exc:
            err = request_error(exc)
            if err.param is None and str(exc).startswith(("stop ", "stop_token_ids ")):
                err.param = str(exc).split(" ", 1)[0]
            raise err from None

    async def build_sampling(self, build: Callable[[], list[SamplingParams]], cheap: bool) -> list[SamplingParams]:
        """`build()`'s sampling params: in a worker thread, unless the caller says they are `cheap` (no grammar to
        compile, no logit_bias to convert, a few choices: microseconds), when a thread hop would cost more than the
        work (4-13 ms a hop, up to 61, under a burst of 32 requests: NOTES run 356)."""
        return build() if cheap else await asyncio.to_thread(build)

    # --- engine ---

    async def submit(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams], *,
                     images: list[Any] | None = None, max_pixels: int | None = None) -> RequestGroup:
        if not self.loop.alive:
            raise engine_unavailable(self.loop.dead_message())
        if self.loop.load() + len(prompts) > self.limits.max_pending_sequences:
            raise APIError(429, "the server is overloaded; retry later", type="rate_limit_error",
                           code="server_overloaded", headers={"Retry-After": "1"})
        group = RequestGroup(request_id, prompts, params, images=images, max_pixels=max_pixels)
        try:
            self.loop.submit(group)
            await group.accepted
        except asyncio.CancelledError:
            group.abort()
            raise
        except EngineDeadError as exc:
            raise engine_unavailable(str(exc)) from None
        except OrinferError as exc:
            raise request_error(exc) from None
        return group

    def check_prompt_chars(self, length: int, param: str) -> None:
        """Refuses a prompt by its size in characters, before any rendering or tokenizing."""
        if length > self.max_prompt_chars:
            raise APIError(400, f"{param}: the prompt has {length} characters; this server takes at most "
                                f"{self.max_prompt_chars} (its context is {self.max_model_len} tokens)", param=param,
                           code="context_length_exceeded")

    async def tokenize(self, text: str, param: str) -> list[int]:
        self.check_prompt_chars(len(text), param)
        try:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates the Rust tokenizer refuses
            raise APIError(400, f"{param} could not be tokenized: is it valid Unicode text? ({type(exc).__name__})",
                           param=param) from None

    # --- output formatting ---

    def chat_logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs:
        return self.logprobs.chat(lps)

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        return self.logprobs.completion(lps, offset)
