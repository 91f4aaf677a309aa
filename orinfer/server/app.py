"""The OpenAI-compatible HTTP API: `build_app(llm, served_model_name, api_key=None, limits=ServerLimits())`.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics, GET /openapi.json.
Every request goes through `_Guard` (API key on every route but /health; HTTP metrics). Handlers read the body
themselves (content type, size limit, strict JSON without NaN), validate it with the pydantic models of `protocol`,
render and tokenize the prompt in a worker thread, then hand the token ids to the engine thread (`engine_loop`).
Every client mistake is a 4xx with an OpenAI-style error object; a 5xx means a bug or a dead engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orinfer.engine.sequence import TokenLogprob
from orinfer.errors import OrinferError, RequestError
from orinfer.sampling_params import SamplingParams
from orinfer.server.engine_loop import EngineDeadError, EngineLoop, EngineStepError, RequestGroup
from orinfer.server.metrics import ServerMetrics
from orinfer.server.protocol import (I64_MAX, I64_MIN, APIError, ChatChoice, ChatCompletionRequest,
                                     ChatCompletionResponse, ChatLogprobs, ChatResponseMessage, CompletionChoice,
                                     CompletionLogprobs, CompletionRequest, CompletionResponse, ModelCard, ModelList,
                                     TokenLogprobEntry, TopLogprob, Usage, SamplingFields, messages_for_template,
                                     read_json, template_kwargs, validate_body)
from orinfer.server.reasoning import ReasoningParser, Split, ThinkState, initial_state, split_reasoning

log = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    """What one request may ask for. Beyond these the answer is a 4xx, never a slow or crashed server."""

    max_body_bytes: int = 4 * 1024 * 1024    # request body (413 beyond)
    max_header_bytes: int = 64 * 1024        # request line + headers (uvicorn's h11_max_incomplete_event_size)
    max_n: int = 16                          # choices per prompt
    max_tokens: int | None = None            # cap on max_tokens (None: the context length)
    max_prompts: int = 64                    # prompts in one /v1/completions request
    max_sequences: int = 64                  # prompts x n in one request
    max_messages: int = 4096                 # messages in one chat
    max_stop: int = 16                       # stop strings
    max_stop_chars: int = 256                # characters per stop string
    max_stop_token_ids: int = 64
    max_pending_sequences: int = 4096        # sequences in or queued for the engine (429 beyond)


def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_DECODER = _byte_decoder()


def _clean_logprob(lp: float) -> float:
    return lp if lp == lp and lp > -9999.0 else -9999.0   # JSON has no -inf / NaN


# --- the server ------------------------------------------------------------------------------------------------------

class _Server:
    """What the handlers share: the model, limits, metrics and the engine loop."""

    def __init__(self, llm: Any, name: str, limits: ServerLimits, reasoning: bool | None) -> None:
        self.llm, self.name, self.limits = llm, name, limits
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.parts.model_config.vocab_size
        self.kv_capacity = self.engine.block_manager.num_blocks * self.engine.config.block_size
        self.created = int(time.time())
        self.loop = EngineLoop(self.engine)
        self.metrics = ServerMetrics(self.loop.stats)
        self.loop.metrics = self.metrics
        has_think = self.tokenizer is not None and self.tokenizer.token_to_id("<think>") is not None \
            and self.tokenizer.token_to_id("</think>") is not None
        self.reasoning = has_think if reasoning is None else reasoning
        self._token_cache: dict[int, tuple[str, list[int]]] = {}

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
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
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

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context length is "
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

    def sampling(self, req: SamplingFields, max_tokens: int, choice: int, logprobs: int | None) -> SamplingParams:
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
                include_stop_str_in_output=bool(req.include_stop_str_in_output), logprobs=logprobs)
        except RequestError as exc:
            err = _request_error(exc)
            if err.param is None and str(exc).startswith(("stop ", "stop_token_ids ")):
                err.param = str(exc).split(" ", 1)[0]
            raise err from None

    # --- engine ---

    async def submit(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams]) -> RequestGroup:
        if not self.loop.alive:
            raise APIError(503, f"the engine is not available: {self.loop.dead_message()}", type="server_error",
                           code="engine_unavailable")
        if self.loop.load() + len(prompts) > self.limits.max_pending_sequences:
            raise APIError(429, "the server is overloaded; retry later", type="rate_limit_error",
                           code="server_overloaded")
        group = RequestGroup(request_id, prompts, params)
        try:
            self.loop.submit(group)
            await group.accepted
        except asyncio.CancelledError:
            group.abort()
            raise
        except EngineDeadError as exc:
            raise APIError(503, f"the engine is not available: {exc}", type="server_error",
                           code="engine_unavailable") from None
        except OrinferError as exc:
            raise _request_error(exc) from None
        return group

    async def tokenize(self, text: str, param: str) -> list[int]:
        try:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates the Rust tokenizer refuses
            raise APIError(400, f"{param} could not be tokenized: is it valid Unicode text? ({type(exc).__name__})",
                           param=param) from None

    # --- output formatting ---

    def token(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._token_cache.get(token_id)
        if cached is None:
            piece = self.tokenizer.id_to_token(token_id) if self.tokenizer is not None and token_id >= 0 else None
            if piece is None:
                raw = b""
            else:
                try:
                    raw = bytes(_BYTE_DECODER[c] for c in piece)
                except KeyError:  # not a byte-level piece (an added token with other characters)
                    raw = piece.encode("utf-8")
            cached = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self._token_cache) < 1_000_000:
                self._token_cache[token_id] = cached
        return cached

    def chat_logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs:
        entries = []
        for lp in lps:
            text, raw = self.token(lp.token_id)
            top = [TopLogprob(token=self.token(t)[0], logprob=_clean_logprob(v), bytes=self.token(t)[1])
                   for t, v in lp.top]
            entries.append(TokenLogprobEntry(token=text, logprob=_clean_logprob(lp.logprob), bytes=raw,
                                             top_logprobs=top))
        return ChatLogprobs(content=entries)

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in lps:
            text = self.token(lp.token_id)[0]
            out.tokens.append(text)
            out.token_logprobs.append(_clean_logprob(lp.logprob))
            out.top_logprobs.append({self.token(t)[0]: _clean_logprob(v) for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(text)
        return out


def _request_error(exc: Exception) -> APIError:
    message = str(exc)
    match = re.match(r"invalid sampling parameter (\w+)=", message)
    code = "context_length_exceeded" if "context length" in message or "KV cache" in message else None
    return APIError(400, message, param=match.group(1) if match else None, code=code)


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not available: {exc}", type="server_error", code="engine_unavailable")
    return APIError(500, str(exc) or "internal error", type="server_error", code="internal_error")


class _Choice:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.tokens = 0
        self.finish_reason: str | None = None


class _ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(request: Request, group: RequestGroup, count: int) -> list[_Choice]:
    """Runs a non-streaming request to the end; aborts it if the client disconnects first."""
    choices = [_Choice() for _ in range(count)]

    async def consume() -> None:
        async for up in group.updates():
            c = choices[up.index]
            c.text.append(up.text)
            c.logprobs.extend(up.logprobs)
            c.tokens = up.num_completion_tokens
            c.finish_reason = up.finish_reason or c.finish_reason

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():
            raise _ClientGone
        consumer.result()
        return choices
    finally:
        for task in (consumer, watcher):
            if not task.done():
                task.cancel()
        group.abort()


class _AbortingStream(StreamingResponse):
    """A server-sent-event stream that aborts its request however the response ends (finished, client gone,
    cancelled before the first chunk)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(',', ':'))}\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# --- the app ---------------------------------------------------------------------------------------------------------

def build_app(llm: Any, served_model_name: str, api_key: str | None = None, limits: ServerLimits | None = None,
              reasoning: bool | None = None) -> FastAPI:
    """The FastAPI app serving `llm` (an `orinfer.LLM`). The engine thread starts with the app's lifespan and stops
    with it. `reasoning`: split Qwen3 <think> output into reasoning_content (None: when the tokenizer has the tags)."""
    srv = _Server(llm, served_model_name, limits or ServerLimits(), reasoning)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        srv.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(srv.loop.stop)

    app = FastAPI(title="orinfer", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = srv
    app.add_middleware(_Guard, api_key=api_key, metrics=srv.metrics, max_header_bytes=srv.limits.max_header_bytes)
    _add_error_handlers(app)
    _add_routes(app, srv)
    _document_bodies(app, srv)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind,
                       code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, f"invalid request: {exc.errors()[:1]}").body(), status_code=400)

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        err = APIError(500, "internal server error", type="server_error", code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)


def _add_routes(app: FastAPI, srv: _Server) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not srv.loop.alive:
            err = APIError(503, f"the engine is not available: {srv.loop.dead_message()}", type="server_error",
                           code="engine_unavailable")
            return JSONResponse(err.body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        card = ModelCard(id=srv.name, created=srv.created, max_model_len=srv.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, srv.limits.max_body_bytes)
        req: ChatCompletionRequest = validate_body(ChatCompletionRequest, body)
        return await _chat(request, srv, req)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(request: Request) -> Response:
        body = await read_json(request, srv.limits.max_body_bytes)
        req: CompletionRequest = validate_body(CompletionRequest, body)
        return await _complete(request, srv, req)


# --- /v1/chat/completions --------------------------------------------------------------------------------------------

async def _chat(request: Request, srv: _Server, req: ChatCompletionRequest) -> Response:
    srv.check_model(req.model)
    n = srv.check_common(req, 1)
    if req.chat_template is not None:
        raise APIError(400, "custom chat templates are not accepted; the model's own template is used",
                       param="chat_template")
    fmt = req.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        raise APIError(400, f"response_format {fmt.get('type')!r} is not supported", param="response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if srv.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot chat; use /v1/completions with token ids")
    messages = messages_for_template(req.messages, srv.limits.max_messages)
    kwargs, thinking = template_kwargs(req.chat_template_kwargs)
    try:
        prompt = await asyncio.to_thread(srv.tokenizer.apply_chat_template, messages,
                                         add_generation_prompt=req.add_generation_prompt is not False,
                                         tools=req.tools, enable_thinking=thinking, **kwargs)
    except OrinferError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - whatever the client's messages/tools make the template do is a 400
        log.debug("chat template failed", exc_info=True)
        raise APIError(400, f"the chat template cannot render these messages ({type(exc).__name__})",
                       param="messages") from None
    ids = await srv.tokenize(prompt, "messages")
    srv.check_prompt(ids, "messages")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = srv.max_tokens(req.max_completion_tokens or req.max_tokens, len(ids), param)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = [srv.sampling(req, max_tokens, i, num_logprobs) for i in range(n)]
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    group = await srv.submit(request_id, [ids] * n, params)
    think = initial_state(prompt) if srv.reasoning else ThinkState.CONTENT
    created = int(time.time())
    if req.stream:
        opts = req.stream_options
        usage = bool(opts and opts.include_usage)
        return _AbortingStream(_chat_stream(srv, group, request_id, created, n, len(ids), think, usage,
                                            bool(req.logprobs)), group.abort)
    try:
        choices = await _collect(request, group, n)
    except _ClientGone:
        return Response(status_code=499)
    except (EngineDeadError, EngineStepError) as exc:
        raise _engine_error(exc) from None
    out = []
    for i, c in enumerate(choices):
        text = "".join(c.text)
        reasoning, content = split_reasoning(text, think) if think is not ThinkState.CONTENT else (None, text)
        out.append(ChatChoice(index=i, message=ChatResponseMessage(content=content, reasoning_content=reasoning),
                              logprobs=srv.chat_logprobs(c.logprobs) if req.logprobs else None,
                              finish_reason=c.finish_reason))
    body = ChatCompletionResponse(id=request_id, created=created, model=srv.name, choices=out,
                                  usage=Usage(**_usage(len(ids), sum(c.tokens for c in choices))))
    return JSONResponse(body.model_dump())


async def _chat_stream(srv: _Server, group: RequestGroup, request_id: str, created: int, n: int, prompt_tokens: int,
                       think: ThinkState, include_usage: bool, want_logprobs: bool) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        obj: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                               "model": srv.name, "choices": choices}
        if include_usage:
            obj["usage"] = usage
        return _sse(obj)

    parsers = [ReasoningParser(think) if think is not ThinkState.CONTENT else None for _ in range(n)]
    pending: list[list[TokenLogprob]] = [[] for _ in range(n)]
    tokens = [0] * n
    try:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(n)])
        async for up in group.updates():
            i, parser = up.index, parsers[up.index]
            tokens[i] = up.num_completion_tokens
            pending[i].extend(up.logprobs)
            split = parser.feed(up.text) if parser is not None else Split(content=up.text)
            if up.finish_reason is not None and parser is not None:
                split += parser.finish()
            delta = {}
            if split.reasoning:
                delta["reasoning_content"] = split.reasoning
            if split.content:
                delta["content"] = split.content
            if not delta and up.finish_reason is None:
                continue  # nothing to show yet (held back); its logprobs go with the next chunk
            lps = srv.chat_logprobs(pending[i]).model_dump() if want_logprobs and pending[i] else None
            pending[i] = []
            if delta:
                yield chunk([{"index": i, "delta": delta, "logprobs": lps, "finish_reason": None}])
                lps = None
            if up.finish_reason is not None:
                yield chunk([{"index": i, "delta": {}, "logprobs": lps, "finish_reason": up.finish_reason}])
        if include_usage:
            yield chunk([], _usage(prompt_tokens, sum(tokens)))
        yield "data: [DONE]\n\n"
    except (EngineDeadError, EngineStepError) as exc:
        err = _engine_error(exc)
        yield _sse(err.body())
        yield "data: [DONE]\n\n"
    finally:
        group.abort()


# --- /v1/completions -------------------------------------------------------------------------------------------------

def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


async def _complete(request: Request, srv: _Server, req: CompletionRequest) -> Response:
    srv.check_model(req.model)
    prompts = _prompt_list(req.prompt)
    if len(prompts) > srv.limits.max_prompts:
        raise APIError(400, f"at most {srv.limits.max_prompts} prompts per request", param="prompt")
    n = srv.check_common(req, len(prompts))
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (no prompt logprobs)", param="echo")
    ids_list, texts = [], []
    for k, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{k}"
        if isinstance(p, str):
            if srv.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param=param)
            ids = await srv.tokenize(p, param) if p else []
        else:
            ids = p
            if any(not 0 <= t < srv.vocab_size for t in ids):
                raise APIError(400, f"{param}: token ids must be in 0..{srv.vocab_size - 1}", param=param)
        srv.check_prompt(ids, param)
        ids_list.append(ids)
        texts.append(p if isinstance(p, str) else (srv.tokenizer.decode(ids) if req.echo and srv.tokenizer else ""))
    prompts_rep, params = [], []
    for ids in ids_list:
        max_tokens = srv.max_tokens(req.max_tokens, len(ids), "max_tokens")
        for i in range(n):
            prompts_rep.append(ids)
            params.append(srv.sampling(req, max_tokens, i, req.logprobs))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    group = await srv.submit(request_id, prompts_rep, params)
    created = int(time.time())
    prompt_tokens = sum(len(ids) for ids in ids_list)
    echoes = [texts[k // n] if req.echo else "" for k in range(len(params))]
    if req.stream:
        opts = req.stream_options
        usage = bool(opts and opts.include_usage)
        return _AbortingStream(_completion_stream(srv, group, request_id, created, echoes, prompt_tokens, usage,
                                                  req.logprobs is not None), group.abort)
    try:
        choices = await _collect(request, group, len(params))
    except _ClientGone:
        return Response(status_code=499)
    except (EngineDeadError, EngineStepError) as exc:
        raise _engine_error(exc) from None
    out = [CompletionChoice(index=k, text=echoes[k] + "".join(c.text), finish_reason=c.finish_reason,
                            logprobs=srv.completion_logprobs(c.logprobs, len(echoes[k]))
                            if req.logprobs is not None else None)
           for k, c in enumerate(choices)]
    body = CompletionResponse(id=request_id, created=created, model=srv.name, choices=out,
                              usage=Usage(**_usage(prompt_tokens, sum(c.tokens for c in choices))))
    return JSONResponse(body.model_dump())


async def _completion_stream(srv: _Server, group: RequestGroup, request_id: str, created: int, echoes: list[str],
                             prompt_tokens: int, include_usage: bool, want_logprobs: bool) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        obj: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                               "model": srv.name, "choices": choices}
        if include_usage:
            obj["usage"] = usage
        return _sse(obj)

    offsets = [len(e) for e in echoes]
    tokens = [0] * len(echoes)
    try:
        for k, echo in enumerate(echoes):
            if echo:
                yield chunk([{"index": k, "text": echo, "logprobs": None, "finish_reason": None}])
        async for up in group.updates():
            k = up.index
            tokens[k] = up.num_completion_tokens
            lps = None
            if want_logprobs and up.logprobs:
                lps = srv.completion_logprobs(up.logprobs, offsets[k]).model_dump()
            offsets[k] += len(up.text)
            yield chunk([{"index": k, "text": up.text, "logprobs": lps, "finish_reason": up.finish_reason}])
        if include_usage:
            yield chunk([], _usage(prompt_tokens, sum(tokens)))
        yield "data: [DONE]\n\n"
    except (EngineDeadError, EngineStepError) as exc:
        yield _sse(_engine_error(exc).body())
        yield "data: [DONE]\n\n"
    finally:
        group.abort()


# --- the guard: API key + HTTP metrics -------------------------------------------------------------------------------

_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json"}


class _Guard:
    """Pure ASGI middleware: refuses oversized request heads (431; uvicorn's h11 limit only bounds a head that
    arrives in pieces), checks `Authorization: Bearer <key>` on every route but /health (in constant time), and counts
    HTTP requests by route and status."""

    def __init__(self, app: Any, api_key: str | None, metrics: ServerMetrics, max_header_bytes: int) -> None:
        self.app, self.metrics = app, metrics
        self.key = api_key.encode() if api_key else None
        self.max_header_bytes = max_header_bytes

    def _head_size(self, scope: dict[str, Any]) -> int:
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        return size + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        status = [0]

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self._head_size(scope) > self.max_header_bytes:
                err = APIError(431, f"the request headers are larger than {self.max_header_bytes} bytes",
                               code="request_header_fields_too_large")
                await JSONResponse(err.body(), status_code=431)(scope, receive, send_status)
                return
            if self.key is not None and path != "/health" and not self._authorized(scope):
                err = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                               code="invalid_api_key")
                response = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.http_requests.inc(route=path if path in _ROUTES else "other", code=str(status[0] or 500))


def _document_bodies(app: FastAPI, srv: _Server) -> None:
    """The handlers parse their bodies themselves (for strict JSON and clear errors); put the request schemas into
    /openapi.json anyway, with this server's model name and limits, so that clients and fuzzers see them."""
    bodies = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            props = js["properties"]
            props["model"] = {"anyOf": [{"type": "string", "enum": [srv.name]}, {"type": "null"}], "default": None}
            props["n"]["anyOf"][0]["maximum"] = srv.limits.max_n
            for key in ("max_tokens", "max_completion_tokens"):
                if key in props and srv.limits.max_tokens is not None:
                    props[key]["anyOf"][0]["maximum"] = srv.limits.max_tokens
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
