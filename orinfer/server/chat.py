"""POST /v1/chat/completions: checks, the chat template (rendered and tokenized in a worker thread), images
(vision-language models; decoded in a worker thread by `images`), then the engine; the answer as one JSON body or as
`chat.completion.chunk` server-sent events, with Qwen3's <think> output split into `reasoning_content` and tool calls
parsed into `tool_calls` (orinfer/tool_calls; the request side in `tools`)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from orinfer.engine.sequence import TokenLogprob
from orinfer.errors import OrinferError, RequestError
from orinfer.server.engine_loop import EngineDeadError, EngineStepError, RequestGroup
from orinfer.server.errors import APIError, engine_error
from orinfer.server.messages import ChatInput, chat_input
from orinfer.server.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatResponseMessage,
                                     TokenizeChatRequest, Usage)
from orinfer.reasoning import ThinkState, initial_state
from orinfer.sampling_params import SamplingParams
from orinfer.server.request_body import template_kwargs
from orinfer.server.structured import structured_outputs
from orinfer.structured.params import StructuredOutputsParams
from orinfer.server.responses import (AbortingStream, ClientGone, collect, finish_stream, json_in_worker,
                                      stream_chunk, stream_usage_options, usage)
from orinfer.server.state import INLINE_SAMPLING_SEQUENCES, ServerState
from orinfer.server.tools import NO_TOOLS, ChatTools, chat_tools, finish_reason
from orinfer.tool_calls import constrain_tool_choice

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


async def render_prompt(srv: ServerState, req: ChatCompletionRequest | TokenizeChatRequest,
                        messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The prompt text of a chat request (in a worker thread) with `tools` in it; template errors are 400s."""
    kwargs, thinking = template_kwargs(req.chat_template_kwargs)
    if req.reasoning_effort is not None:  # a template variable, as vLLM passes it (chat_template_kwargs win)
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    try:
        return await asyncio.to_thread(srv.tokenizer.apply_chat_template, messages,
                                       add_generation_prompt=req.add_generation_prompt is not False,
                                       tools=tools, enable_thinking=thinking, **kwargs)
    except OrinferError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - whatever the client's messages/tools make the template do is a 400
        log.debug("chat template failed", exc_info=True)
        raise APIError(400, f"the chat template cannot render these messages ({type(exc).__name__})",
                       param="messages") from None


def text_length(content: Any) -> int:
    """Characters of a template message's content: a string, or parts whose text counts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return 0


@dataclass
class _Prepared:
    """What the checks of a chat request produce before its prompt is rendered."""

    n: int
    tools: ChatTools
    spec: StructuredOutputsParams | None
    chat_in: ChatInput
    max_pixels: int | None


def _prepare(srv: ServerState, req: ChatCompletionRequest) -> _Prepared:
    """The request's checks and template input: run in a worker thread, as each walks lists of the body (tools,
    messages, parts) that can hold tens of thousands of items."""
    n = _check_fields(srv, req)
    tools = chat_tools(req, srv.tool_format)
    spec = structured_outputs(req)
    chat_in = chat_input(req.messages, srv.limits.max_messages, srv.multimodal)
    max_pixels = srv.images.check(len(chat_in.images), req.mm_processor_kwargs) if chat_in.images else None
    srv.check_prompt_chars(sum(text_length(m.get("content")) for m in chat_in.messages), "messages")
    return _Prepared(n, tools, spec, chat_in, max_pixels)


async def chat(request: Request, srv: ServerState, req: ChatCompletionRequest) -> Response:
    prep = await asyncio.to_thread(_prepare, srv, req)
    n, tools, spec, chat_in, max_pixels = prep.n, prep.tools, prep.spec, prep.chat_in, prep.max_pixels
    prompt = await render_prompt(srv, req, chat_in.messages, tools.prompt_tools)
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

    def sampling() -> list[SamplingParams]:
        """Per choice (n of them), with logit_bias and the tools' grammar: in a worker thread, like `_prepare`."""
        out = [srv.sampling(req, max_tokens, i, num_logprobs, thinking_token_budget=req.thinking_token_budget,
                            structured_outputs=spec, think_state=think.value) for i in range(n)]
        try:
            return [constrain_tool_choice(p, tools.choice, tools.prompt_tools, srv.tool_format,
                                          tools.max_calls is None) for p in out]
        except RequestError as exc:  # the choice against the request's constraint, or a tool the grammar can't take
            raise APIError(400, str(exc), param=getattr(exc, "param", None) or "tools") from None

    params = await srv.build_sampling(sampling, spec is None and not req.logit_bias and not tools.prompt_tools
                                      and n <= INLINE_SAMPLING_SEQUENCES)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    group = await srv.submit(request_id, [ids] * n, params, images=images, max_pixels=max_pixels)
    prompt_tokens = group.accepted.result()[0]  # as the engine counts it (visual tokens included)
    created = int(time.time())
    show_reasoning = req.include_reasoning is not False
    if req.stream:
        include_usage, continuous = stream_usage_options(req)
        return AbortingStream(chat_stream(srv, group, request_id, created, n, prompt_tokens, think, include_usage,
                                          bool(req.logprobs), tools, include_reasoning=show_reasoning,
                                          continuous_usage=continuous), group.abort)
    try:
        choices = await collect(request, group, n)
    except ClientGone:
        return Response(status_code=499)
    except (EngineDeadError, EngineStepError) as exc:
        raise engine_error(exc) from None

    def build() -> ChatCompletionResponse:
        out = []
        for i, c in enumerate(choices):
            res = tools.split("".join(c.text), think)
            calls = [call.to_openai() for call in res.calls]
            content = res.content if res.content or not calls else None  # OpenAI: null beside calls
            reasoning = res.reasoning if show_reasoning else None
            message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls)
            out.append(ChatChoice(index=i, message=message,
                                  logprobs=srv.chat_logprobs(c.logprobs) if req.logprobs else None,
                                  finish_reason=finish_reason(c.finish_reason, bool(calls))))
        return ChatCompletionResponse(id=request_id, created=created, model=srv.name, choices=out,
                                      usage=Usage(**usage(prompt_tokens, sum(c.tokens for c in choices),
                                                          [c.cached for c in choices], n)))

    return await json_in_worker(build)


def chat_stream(srv: ServerState, group: RequestGroup, request_id: str, created: int, n: int, prompt_tokens: int,
                think: ThinkState, include_usage: bool, want_logprobs: bool,
                tools: ChatTools = NO_TOOLS, *, include_reasoning: bool = True,
                continuous_usage: bool = False) -> AsyncIterator[str]:
    """The whole SSE stream of a streaming chat (`_chat_events`, then [DONE]; see `finish_stream`).
    `include_reasoning=False` drops reasoning_content deltas; `continuous_usage`: usage in every chunk."""
    return finish_stream(_chat_events(srv, group, request_id, created, n, prompt_tokens, think, include_usage,
                                      want_logprobs, tools, include_reasoning, continuous_usage), group)


async def _chat_events(srv: ServerState, group: RequestGroup, request_id: str, created: int, n: int,
                       prompt_tokens: int, think: ThinkState, include_usage: bool,
                       want_logprobs: bool, tools: ChatTools, include_reasoning: bool = True,
                       continuous_usage: bool = False) -> AsyncIterator[str]:
    """The SSE events of a streaming chat: a role chunk per choice, then one chunk per update (updates already
    queued arrive merged, see RequestGroup.updates), a finish chunk per choice, the usage chunk. A tool call goes out
    as OpenAI's deltas: its index, id, type and name first, then fragments of its arguments."""
    def chunk(choices: list[dict[str, Any]], usage_obj: dict[str, int] | None = None) -> str:
        if continuous_usage and usage_obj is None:
            usage_obj = usage(prompt_tokens, sum(tokens), cached, n)
        return stream_chunk(request_id, "chat.completion.chunk", created, srv.name, choices, usage_obj, include_usage)

    parsers = [tools.parser(think) for _ in range(n)]
    has_calls = [False] * n
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
        split = parser.feed(up.text)
        if up.finish_reason is not None:
            split += parser.finish()
        delta: dict[str, Any] = {}
        if split.reasoning and include_reasoning:
            delta["reasoning_content"] = split.reasoning
        if split.content:
            delta["content"] = split.content
        if split.calls:
            delta["tool_calls"] = [d.to_openai() for d in split.calls]
            has_calls[i] = True
        if not delta and up.finish_reason is None:
            continue  # nothing to show yet (held back); its logprobs go with the next chunk
        lps = srv.chat_logprobs(pending[i]).model_dump() if want_logprobs and pending[i] else None
        pending[i] = []
        if delta:
            yield chunk([{"index": i, "delta": delta, "logprobs": lps, "finish_reason": None}])
            lps = None
        if up.finish_reason is not None:
            yield chunk([{"index": i, "delta": {}, "logprobs": lps,
                          "finish_reason": finish_reason(up.finish_reason, has_calls[i])}])
    if include_usage:
        yield chunk([], usage(prompt_tokens, sum(tokens), cached, n))
