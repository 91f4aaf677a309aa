"""The OpenAI-compatible HTTP API: `build_app(llm, served_model_name, api_key=None, limits=ServerLimits())`.

Routes: POST /v1/chat/completions (`chat`), POST /v1/completions (`completions`), GET /v1/models and
/v1/models/{id}, POST /tokenize and /detokenize (vLLM's, `tokenize`), GET /version, GET and HEAD /health,
GET /metrics, GET /openapi.json; no redirects (a trailing slash is a 404). Every request goes through
`guard.Guard` (request-head size, API key on every route but /health, HTTP metrics). Handlers read the body
themselves (`request_body`: JSON content type in UTF-8, size limit, strict JSON without NaN, a limit on its
values) and validate it with the pydantic models of `protocol`, in a worker thread unless it is small; they render
and tokenize the prompt (and decode images) in worker threads, then hand the token ids to the engine thread
(`engine_loop`), which `orinfer serve` runs in a child process (`engine_process`: the event loop then never waits
for the engine's interpreter). Every client mistake is a 4xx with an OpenAI-style error object (`errors`); a 5xx
means a bug or a dead engine.

    app.py            this file: the app factory, routes, /openapi.json
    state.py          ServerLimits, ServerState (checks shared by the endpoints, submit, tokenize)
    chat.py           /v1/chat/completions and its stream      completions.py   /v1/completions and its stream
    messages.py       chat messages -> template messages + image parts
    images.py         image limits, sources and decoding       logprobs.py      logprobs in the OpenAI formats
    responses.py      non-streaming collection, SSE helpers    request_body.py  reading and validating bodies
    errors.py         APIError and the error handlers          guard.py         API key, head size, HTTP metrics
    engine_loop.py    the engine thread                        request_group.py one request's side of it
    engine_process.py the engine thread in a child process     json_count.py    counting a body's values
    interpreter.py    the collector's full passes and the GIL switch interval, for the event loop's latency
    metrics.py        Prometheus /metrics                      (the <think> split: orinfer/reasoning.py)
    tokenize.py       /tokenize and /detokenize
    cli.py            `orinfer serve`, BackgroundServer       tools.py         tools, tool_choice (parsing: tool_calls/)
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from orinfer import __version__
from orinfer.server.chat import chat
from orinfer.server.completions import complete
from orinfer.server.errors import add_error_handlers, engine_unavailable
from orinfer.server.guard import Guard
from orinfer.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                     CompletionResponse, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                                     TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse,
                                     VersionResponse)
from orinfer.server.state import ServerLimits, ServerState
from orinfer.server.tokenize import detokenize, tokenize, tokenize_request_model

__all__ = ["ServerLimits", "build_app"]


def build_app(llm: Any, served_model_name: str, api_key: str | None = None, limits: ServerLimits | None = None,
              reasoning: bool | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving `llm` (an `orinfer.LLM`, or an `EngineProcess` running one in a child process). The
    engine thread starts with the app's lifespan and stops with it (an engine process, with its end). `reasoning`:
    split Qwen3 <think> output into reasoning_content (None: when the tokenizer has the tags). `tool_call_parser`:
    an `EngineArgs.tool_call_parser` value (None: the in-process engine's setting, else "auto").
    The server decodes request images itself, under `limits`; it turns the engine's own local-file loading off."""
    srv = ServerState(llm, served_model_name, limits or ServerLimits(), reasoning, tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        srv.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(srv.loop.stop)

    # redirect_slashes=False: Starlette would answer /health/ with a redirect to an absolute URL built from the
    # request's Host header; a path with a trailing slash is a 404 like any other unknown path.
    app = FastAPI(title="orinfer", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False)
    app.state.server = srv
    app.add_middleware(Guard, api_key=api_key, metrics=srv.metrics, max_header_bytes=srv.limits.max_header_bytes,
                       allowed_hosts=srv.limits.allowed_hosts)
    add_error_handlers(app)
    _add_routes(app, srv)
    _document_bodies(app, srv)
    return app


def _add_routes(app: FastAPI, srv: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not srv.loop.alive:
            return JSONResponse(engine_unavailable(srv.loop.dead_message()).body(), status_code=503)
        return JSONResponse({"status": "ok"})

    # HEAD /health for load balancers and probes (same status; the server sends no body). A route of its own, out of
    # /openapi.json, so that the GET operation keeps its unique operationId.
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def card() -> ModelCard:
        return ModelCard(id=srv.name, created=srv.created, max_model_len=srv.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return ModelList(data=[card()]).model_dump()

    # {model_id:path}: served names may hold slashes ("Qwen/Qwen3-8B").
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str) -> dict[str, Any]:
        srv.check_model(model_id)  # 404 model_not_found, in OpenAI's error shape
        return card().model_dump()

    @app.get("/version", response_model=VersionResponse)
    async def version() -> dict[str, Any]:
        return {"version": __version__}

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_route(request: Request) -> dict[str, Any]:
        req = await srv.bodies.read(request, tokenize_request_model)
        return (await tokenize(srv, req)).model_dump()

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_route(request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = await srv.bodies.read(request, DetokenizeRequest)
        return (await detokenize(srv, req)).model_dump()

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await srv.bodies.read(request, ChatCompletionRequest)
        return await chat(request, srv, req)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await srv.bodies.read(request, CompletionRequest)
        return await complete(request, srv, req)


def _document_bodies(app: FastAPI, srv: ServerState) -> None:
    """The handlers parse their bodies themselves (for strict JSON and clear errors); put the request schemas into
    /openapi.json anyway, with this server's model name and limits, so that clients and fuzzers see them."""
    bodies = {"/v1/chat/completions": [ChatCompletionRequest], "/v1/completions": [CompletionRequest],
              "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest], "/detokenize": [DetokenizeRequest]}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, models in bodies.items():
            refs = []
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                props = js["properties"]
                props["model"] = {"anyOf": [{"type": "string", "enum": [srv.name]}, {"type": "null"}],
                                  "default": None}
                if "n" in props:
                    props["n"]["anyOf"][0]["maximum"] = min(srv.limits.max_n, srv.limits.max_pending_sequences)
                for key in ("max_tokens", "max_completion_tokens"):
                    if key in props and srv.limits.max_tokens is not None:
                        props[key]["anyOf"][0]["maximum"] = srv.limits.max_tokens
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
                refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
            body = refs[0] if len(refs) == 1 else {"anyOf": refs}
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": body}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
