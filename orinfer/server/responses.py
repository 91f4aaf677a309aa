"""How results go back to the client: `collect` runs a non-streaming request to its end (aborting it when the
client leaves first), `AbortingStream` sends server-sent events and aborts its request however the response ends,
`sse` writes one event, `usage` the usage object."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from orinfer.engine.sequence import TokenLogprob
from orinfer.server.errors import engine_error
from orinfer.server.request_group import EngineDeadError, EngineStepError, RequestGroup


class Choice:
    """One choice of a non-streaming response, accumulated from its updates."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.tokens = 0
        self.cached = 0                 # prompt tokens served from the prefix cache
        self.finish_reason: str | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, group: RequestGroup, count: int) -> list[Choice]:
    """Runs a non-streaming request to the end; aborts it (and raises ClientGone) if the client disconnects first."""
    choices = [Choice() for _ in range(count)]

    async def consume() -> None:
        async for up in group.updates():
            c = choices[up.index]
            c.text.append(up.text)
            c.logprobs.extend(up.logprobs)
            c.tokens = up.num_completion_tokens
            c.cached = up.num_cached_tokens
            c.finish_reason = up.finish_reason or c.finish_reason
            if up.prompt_logprobs is not None:
                c.prompt_logprobs = up.prompt_logprobs

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():
            raise ClientGone
        consumer.result()
        return choices
    finally:
        for task in (consumer, watcher):
            if not task.done():
                task.cancel()
        group.abort()


class AbortingStream(StreamingResponse):
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


async def json_in_worker(build: Callable[[], BaseModel]) -> Response:
    """The JSON response of `build()`, built and encoded in a worker thread: a large body (16 choices x 2,000 tokens
    x 20 top logprobs is ~48 MB) would otherwise hold the event loop, and every other client, for seconds. Bytes as
    JSONResponse writes them."""
    def render() -> bytes:
        return json.dumps(build().model_dump(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    return Response(await asyncio.to_thread(render), media_type="application/json")


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_chunk(request_id: str, kind: str, created: int, model: str, choices: list[dict[str, Any]],
                 usage_obj: dict[str, int] | None, include_usage: bool) -> str:
    """One SSE chunk of a streamed response (`kind`: "chat.completion.chunk" or "text_completion"); with
    stream_options.include_usage every chunk carries `usage` (null but on the last one), as OpenAI sends it."""
    obj: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
    if include_usage:
        obj["usage"] = usage_obj
    return sse(obj)


def stream_usage_options(req: Any) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a streaming request's stream_options. As in vLLM, usage in every
    chunk (continuous_usage_stats) needs include_usage too."""
    opts = req.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts.continuous_usage_stats)


def usage(prompt: int, completion: int, cached: list[int] | None = None, n: int = 1) -> dict[str, Any]:
    """OpenAI's usage object. `cached`: each choice's prompt tokens served from the prefix cache, choices of one prompt
    adjacent (n per prompt): a prompt counts once, as in prompt_tokens (`prompt_tokens_details.cached_tokens`)."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": sum(cached[::n])}
    return out


async def finish_stream(events: AsyncIterator[str], group: RequestGroup) -> AsyncIterator[str]:
    """A stream's SSE events, then [DONE]. An engine failure mid-stream becomes an OpenAI error event (then [DONE]);
    the group is aborted however the stream ends, so a client that went away frees its KV blocks at once."""
    try:
        async for event in events:
            yield event
        yield SSE_DONE
    except (EngineDeadError, EngineStepError) as exc:
        yield sse(engine_error(exc).body())
        yield SSE_DONE
    finally:
        group.abort()
