"""POST /v1/chat/completions: checks, the chat template (rendered and tokenized in a worker thread), images
(vision-language models; decoded in a worker thread by `images`), then the engine; the answer as one JSON body or as
`chat.completion.chunk` server-sent events, with Qwen3's <think> output split into `reasoning_content`."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from orinfer.engine.sequence import TokenLogprob
from orinfer.errors import OrinferError
from orinfer.server.engine_loop import EngineDeadError, EngineStepError, RequestGroup
from orinfer.server.errors import APIError, engine_error
from orinfer.server.messages import chat_input
from orinfer.server.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatResponseMessage,
                                     Usage)
from orinfer.server.reasoning import ReasoningParser, Split, ThinkState, initial_state, split_reasoning
from orinfer.server.request_body import template_kwargs
from orinfer.server.structured import structured_outputs
from orinfer.server.responses import (AbortingStream, ClientGone, collect, finish_stream, json_in_worker,
                                      stream_chunk, usage)
from orinfer.server.state import ServerState

log = logging.getLogger(__name__)


def _check_fields(srv: ServerState, req: ChatCompletionRequest) -> int:
    srv.check_model(req.model)
    n = srv.check_common(req, 1)
    if req.chat_template is not None:
        raise APIError(400, "custom chat templates are not accepted; the model's own template is used",
                       param="chat_template")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if srv.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot chat; use /v1/completions with token ids")
    return n


async def _render(srv: ServerState, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
    kwargs, thinking = template_kwargs(req.chat_template_kwargs)
    try:
        return await asyncio.to_thread(srv.tokenizer.apply_chat_template, messages,
                                       add_generation_prompt=req.add_generation_prompt is not False,
                                       tools=req.tools, enable_thinking=thinking, **kwargs)
    except OrinferError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - whatever the client's messages/tools make the template do is a 400
        log.debug("chat template failed", exc_info=True)
        raise APIError(400, f"the chat template cannot render these messages ({type(exc).__name__})",
                       param="messages") from None


def _text_length(content: Any) -> int:
    """Characters of a template message's content: a string, or parts whose text counts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return 0


async def chat(request: Request, srv: ServerState, req: ChatCompletionRequest) -> Response:
    n = _check_fields(srv, req)
    spec = structured_outputs(req)
    chat_in = chat_input(req.messages, srv.limits.max_messages, srv.multimodal)
    max_pixels = srv.images.check(len(chat_in.images), req.mm_processor_kwargs) if chat_in.images else None
    srv.check_prompt_chars(sum(_text_length(m.get("content")) for m in chat_in.messages), "messages")
    prompt = await _render(srv, req, chat_in.messages)
    ids = await srv.tokenize(prompt, "messages")
    srv.check_prompt(ids, "messages")
    prompt_len = len(ids)
    images = None
    if chat_in.images:
        loaded = await srv.images.load(chat_in.images, max_pixels)
        images = loaded.images
        prompt_len += sum(loaded.token_counts) - len(loaded.token_counts)  # each placeholder grows to its tokens
        srv.check_prompt(ids, "messages", prompt_len)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = srv.max_tokens(req.max_completion_tokens or req.max_tokens, prompt_len, param)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    think = initial_state(prompt) if srv.reasoning else ThinkState.CONTENT
    params = [srv.sampling(req, max_tokens, i, num_logprobs, spec, think.value) for i in range(n)]
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    group = await srv.submit(request_id, [ids] * n, params, images=images, max_pixels=max_pixels)
    prompt_tokens = group.accepted.result()[0]  # as the engine counts it (visual tokens included)
    created = int(time.time())
    if req.stream:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        return AbortingStream(chat_stream(srv, group, request_id, created, n, prompt_tokens, think, include_usage,
                                          bool(req.logprobs)), group.abort)
    try:
        choices = await collect(request, group, n)
    except ClientGone:
        return Response(status_code=499)
    except (EngineDeadError, EngineStepError) as exc:
        raise engine_error(exc) from None

    def build() -> ChatCompletionResponse:
        out = []
        for i, c in enumerate(choices):
            text = "".join(c.text)
            reasoning, content = split_reasoning(text, think) if think is not ThinkState.CONTENT else (None, text)
            out.append(ChatChoice(index=i, message=ChatResponseMessage(content=content, reasoning_content=reasoning),
                                  logprobs=srv.chat_logprobs(c.logprobs) if req.logprobs else None,
                                  finish_reason=c.finish_reason))
        return ChatCompletionResponse(id=request_id, created=created, model=srv.name, choices=out,
                                      usage=Usage(**usage(prompt_tokens, sum(c.tokens for c in choices),
                                                          [c.cached for c in choices], n)))

    return await json_in_worker(build)


def chat_stream(srv: ServerState, group: RequestGroup, request_id: str, created: int, n: int, prompt_tokens: int,
                think: ThinkState, include_usage: bool, want_logprobs: bool) -> AsyncIterator[str]:
    """The whole SSE stream of a streaming chat (`_chat_events`, then [DONE]; see `finish_stream`)."""
    return finish_stream(_chat_events(srv, group, request_id, created, n, prompt_tokens, think, include_usage,
                                      want_logprobs), group)


async def _chat_events(srv: ServerState, group: RequestGroup, request_id: str, created: int, n: int,
                       prompt_tokens: int, think: ThinkState, include_usage: bool,
                       want_logprobs: bool) -> AsyncIterator[str]:
    """The SSE events of a streaming chat: a role chunk per choice, then one chunk per update (updates already
    queued arrive merged, see RequestGroup.updates), a finish chunk per choice, the usage chunk."""
    def chunk(choices: list[dict[str, Any]], usage_obj: dict[str, int] | None = None) -> str:
        return stream_chunk(request_id, "chat.completion.chunk", created, srv.name, choices, usage_obj, include_usage)

    parsers = [ReasoningParser(think) if think is not ThinkState.CONTENT else None for _ in range(n)]
    pending: list[list[TokenLogprob]] = [[] for _ in range(n)]
    tokens = [0] * n
    cached = [0] * n
    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(n)])
    async for up in group.updates():
        i, parser = up.index, parsers[up.index]
        tokens[i] = up.num_completion_tokens
        cached[i] = up.num_cached_tokens
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
        yield chunk([], usage(prompt_tokens, sum(tokens), cached, n))
