"""POST /v1/completions: one prompt or a batch (text or token ids) x n choices; the answer as one JSON body or as
`text_completion` server-sent events. `echo` puts the prompt before the text; with `logprobs` too, the logprobs
start with the prompt's tokens (the first one's null), as OpenAI's legacy completions and vLLM return them: the
engine computes them from the prompt's rows (SamplingParams.prompt_logprobs). `max_tokens: 0` with `echo` returns
the prompt only (scoring a text by its logprobs, as vLLM allows): the engine samples one token, which is dropped."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from orinfer.sampling_params import SamplingParams
from orinfer.server.engine_loop import EngineDeadError, EngineStepError, RequestGroup, SeqUpdate
from orinfer.server.errors import APIError, engine_error
from orinfer.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from orinfer.server.responses import (AbortingStream, ClientGone, collect, finish_stream, json_in_worker,
                                      stream_chunk, stream_usage_options, usage)
from orinfer.server.state import INLINE_SAMPLING_SEQUENCES, ServerState
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
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens: 0 needs echo: true (the prompt is then all of the answer)",
                       param="max_tokens")
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
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
            if ids and max(ids) >= srv.vocab_size:  # ids are >= 0 (validated); max() at C speed over a long prompt
                raise APIError(400, f"{param}: token ids must be in 0..{srv.vocab_size - 1}", param=param)
        srv.check_prompt(ids, param)
        ids_list.append(ids)
        texts.append(p if isinstance(p, str) else (srv.tokenizer.decode(ids) if req.echo and srv.tokenizer else ""))
    prompts_rep = [ids for ids in ids_list for _ in range(n)]

    def sampling() -> list[SamplingParams]:
        """Per prompt and choice (up to max_sequences), with logit_bias: in a worker thread."""
        params = []
        for ids in ids_list:
            max_tokens = srv.max_tokens(req.max_tokens or (1 if req.max_tokens == 0 else None), len(ids),
                                        "max_tokens")
            params += [srv.sampling(req, max_tokens, i, req.logprobs, structured_outputs=spec,
                                    prompt_logprobs=req.logprobs if req.echo else None) for i in range(n)]
        return params

    params = await srv.build_sampling(sampling, spec is None and not req.logit_bias
                                      and len(prompts_rep) <= INLINE_SAMPLING_SEQUENCES)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    group = await srv.submit(request_id, prompts_rep, params)
    created = int(time.time())
    prompt_tokens = sum(len(ids) for ids in ids_list)
    echoes = [texts[k // n] if req.echo else "" for k in range(len(params))]
    echo_ids = [ids_list[k // n] for k in range(len(params))] if req.echo and req.logprobs is not None else None
    if req.stream:
        include_usage, continuous = stream_usage_options(req)
        return AbortingStream(completion_stream(srv, group, request_id, created, echoes, prompt_tokens,
                                                include_usage, req.logprobs is not None, n,
                                                continuous_usage=continuous, echo_ids=echo_ids,
                                                prompt_only=req.max_tokens == 0), group.abort)
    try:
        choices = await collect(request, group, len(params))
    except ClientGone:
        return Response(status_code=499)
    except (EngineDeadError, EngineStepError) as exc:
        raise engine_error(exc) from None
    if req.max_tokens == 0:
        for c in choices:
            c.text, c.logprobs, c.tokens, c.finish_reason = [], [], 0, "length"

    def logprobs(k: int, c: Any) -> CompletionLogprobs | None:
        if req.logprobs is None:
            return None
        out = srv.completion_logprobs(c.logprobs, len(echoes[k]))
        if echo_ids is None:
            return out
        return _joined(srv.logprobs.prompt(echo_ids[k], c.prompt_logprobs), out)

    def build() -> CompletionResponse:
        out = [CompletionChoice(index=k, text=echoes[k] + "".join(c.text), finish_reason=c.finish_reason,
                                logprobs=logprobs(k, c))
               for k, c in enumerate(choices)]
        return CompletionResponse(id=request_id, created=created, model=srv.name, choices=out,
                                  usage=Usage(**usage(prompt_tokens, sum(c.tokens for c in choices),
                                                      [c.cached for c in choices], n)))

    return await json_in_worker(build)


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def completion_stream(srv: ServerState, group: RequestGroup, request_id: str, created: int, echoes: list[str],
                      prompt_tokens: int, include_usage: bool, want_logprobs: bool, n: int = 1, *,
                      continuous_usage: bool = False, echo_ids: list[list[int]] | None = None,
                      prompt_only: bool = False) -> AsyncIterator[str]:
    """The whole SSE stream of a streaming completion (`_completion_events`, then [DONE]; see `finish_stream`).
    `n`: choices per prompt (adjacent); `continuous_usage`: usage in every chunk; `echo_ids`: each choice's prompt
    ids when the echoed prompts carry their logprobs; `prompt_only` (max_tokens 0): the sampled token is dropped."""
    return finish_stream(_completion_events(srv, group, request_id, created, echoes, prompt_tokens, include_usage,
                                            want_logprobs, n, continuous_usage, echo_ids, prompt_only), group)


async def _completion_events(srv: ServerState, group: RequestGroup, request_id: str, created: int,
                             echoes: list[str], prompt_tokens: int, include_usage: bool,
                             want_logprobs: bool, n: int, continuous_usage: bool = False,
                             echo_ids: list[list[int]] | None = None,
                             prompt_only: bool = False) -> AsyncIterator[str]:
    """The SSE events of a streaming completion: the echoed prompts (with their logprobs: as the first update of each
    choice brings them), one chunk per update (updates already queued arrive merged, see RequestGroup.updates), the
    usage chunk."""
    def chunk(choices: list[dict[str, Any]], usage_obj: dict[str, int] | None = None) -> str:
        if continuous_usage and usage_obj is None:
            usage_obj = usage(prompt_tokens, sum(tokens), cached, n)
        return stream_chunk(request_id, "text_completion", created, srv.name, choices, usage_obj, include_usage)

    offsets = [len(e) for e in echoes]
    tokens = [0] * len(echoes)
    cached = [0] * len(echoes)
    echo_pending = [bool(e) and echo_ids is not None for e in echoes]
    for k, echo in enumerate(echoes):
        if echo and not echo_pending[k]:
            yield chunk([{"index": k, "text": echo, "logprobs": None, "finish_reason": None}])
    async for up in group.updates():
        k = up.index
        if prompt_only:
            up = SeqUpdate(k, "", [], 0, up.finish_reason and "length", up.num_cached_tokens, up.prompt_logprobs)
        if echo_pending[k]:
            echo_pending[k] = False
            lps = srv.logprobs.prompt(echo_ids[k], up.prompt_logprobs).model_dump()
            yield chunk([{"index": k, "text": echoes[k], "logprobs": lps, "finish_reason": None}])
        tokens[k] = up.num_completion_tokens
        cached[k] = up.num_cached_tokens
        lps = None
        if want_logprobs and up.logprobs:
            lps = srv.completion_logprobs(up.logprobs, offsets[k]).model_dump()
        offsets[k] += len(up.text)
        yield chunk([{"index": k, "text": up.text, "logprobs": lps, "finish_reason": up.finish_reason}])
    if include_usage:
        yield chunk([], usage(prompt_tokens, sum(tokens), cached, n))
