"""POST /v1/completions: one prompt or a batch (text or token ids) x n choices; the answer as one JSON body or as
`text_completion` server-sent events."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from orinfer.server.engine_loop import EngineDeadError, EngineStepError, RequestGroup
from orinfer.server.errors import APIError, engine_error
from orinfer.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from orinfer.server.responses import (AbortingStream, ClientGone, collect, finish_stream, json_in_worker,
                                      stream_chunk, usage)
from orinfer.server.state import ServerState
from orinfer.server.structured import structured_outputs


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _check_fields(srv: ServerState, req: CompletionRequest, prompts: list[Any]) -> int:
    if len(prompts) > srv.limits.max_prompts:
        raise APIError(400, f"at most {srv.limits.max_prompts} prompts per request", param="prompt")
    n = srv.check_common(req, len(prompts))
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (no prompt logprobs)", param="echo")
    return n


async def complete(request: Request, srv: ServerState, req: CompletionRequest) -> Response:
    srv.check_model(req.model)
    prompts = _prompt_list(req.prompt)
    n = _check_fields(srv, req, prompts)
    spec = structured_outputs(req)
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
            params.append(srv.sampling(req, max_tokens, i, req.logprobs, spec))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    group = await srv.submit(request_id, prompts_rep, params)
    created = int(time.time())
    prompt_tokens = sum(len(ids) for ids in ids_list)
    echoes = [texts[k // n] if req.echo else "" for k in range(len(params))]
    if req.stream:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        return AbortingStream(completion_stream(srv, group, request_id, created, echoes, prompt_tokens,
                                                include_usage, req.logprobs is not None, n), group.abort)
    try:
        choices = await collect(request, group, len(params))
    except ClientGone:
        return Response(status_code=499)
    except (EngineDeadError, EngineStepError) as exc:
        raise engine_error(exc) from None

    def build() -> CompletionResponse:
        out = [CompletionChoice(index=k, text=echoes[k] + "".join(c.text), finish_reason=c.finish_reason,
                                logprobs=srv.completion_logprobs(c.logprobs, len(echoes[k]))
                                if req.logprobs is not None else None)
               for k, c in enumerate(choices)]
        return CompletionResponse(id=request_id, created=created, model=srv.name, choices=out,
                                  usage=Usage(**usage(prompt_tokens, sum(c.tokens for c in choices),
                                                      [c.cached for c in choices], n)))

    return await json_in_worker(build)


def completion_stream(srv: ServerState, group: RequestGroup, request_id: str, created: int, echoes: list[str],
                      prompt_tokens: int, include_usage: bool, want_logprobs: bool, n: int = 1
                      ) -> AsyncIterator[str]:
    """The whole SSE stream of a streaming completion (`_completion_events`, then [DONE]; see `finish_stream`).
    `n`: choices per prompt (adjacent)."""
    return finish_stream(_completion_events(srv, group, request_id, created, echoes, prompt_tokens, include_usage,
                                            want_logprobs, n), group)


async def _completion_events(srv: ServerState, group: RequestGroup, request_id: str, created: int,
                             echoes: list[str], prompt_tokens: int, include_usage: bool,
                             want_logprobs: bool, n: int) -> AsyncIterator[str]:
    """The SSE events of a streaming completion: the echoed prompts, one chunk per update (updates already queued
    arrive merged, see RequestGroup.updates), the usage chunk."""
    def chunk(choices: list[dict[str, Any]], usage_obj: dict[str, int] | None = None) -> str:
        return stream_chunk(request_id, "text_completion", created, srv.name, choices, usage_obj, include_usage)

    offsets = [len(e) for e in echoes]
    tokens = [0] * len(echoes)
    cached = [0] * len(echoes)
    for k, echo in enumerate(echoes):
        if echo:
            yield chunk([{"index": k, "text": echo, "logprobs": None, "finish_reason": None}])
    async for up in group.updates():
        k = up.index
        tokens[k] = up.num_completion_tokens
        cached[k] = up.num_cached_tokens
        lps = None
        if want_logprobs and up.logprobs:
            lps = srv.completion_logprobs(up.logprobs, offsets[k]).model_dump()
        offsets[k] += len(up.text)
        yield chunk([{"index": k, "text": up.text, "logprobs": lps, "finish_reason": up.finish_reason}])
    if include_usage:
        yield chunk([], usage(prompt_tokens, sum(tokens), cached, n))
