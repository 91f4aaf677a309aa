"""vLLM's POST /tokenize (a prompt, or chat messages rendered as /v1/chat/completions renders them, -> token ids)
and POST /detokenize (token ids -> text). Tokenizing and decoding run in worker threads under the prompt size limits,
so a large body never holds the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from orinfer.server.chat import render_prompt, text_length
from orinfer.server.errors import APIError
from orinfer.server.messages import ChatInput, chat_input
from orinfer.server.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                     TokenizeCompletionRequest, TokenizeResponse)
from orinfer.server.state import ServerState


def tokenize_request_model(body: Any) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    """Which of the two /tokenize bodies `body` is: one with `messages` is a chat."""
    return TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest


def _need_tokenizer(srv: ServerState) -> None:
    if srv.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")


def _template_input(srv: ServerState, req: TokenizeChatRequest) -> ChatInput:
    """The template messages of a chat, refused by their characters: in a worker thread, as it walks every message
    and part of the body."""
    chat_in = chat_input(req.messages, srv.limits.max_messages, srv.multimodal)
    if chat_in.images:
        raise APIError(400, "/tokenize does not take images (their token count depends on their size)",
                       param="messages")
    srv.check_prompt_chars(sum(text_length(m.get("content")) for m in chat_in.messages), "messages")
    return chat_in


async def tokenize(srv: ServerState, req: TokenizeChatRequest | TokenizeCompletionRequest) -> TokenizeResponse:
    srv.check_model(req.model)
    _need_tokenizer(srv)
    if isinstance(req, TokenizeChatRequest):
        chat_in = await asyncio.to_thread(_template_input, srv, req)
        prompt = await render_prompt(srv, req, chat_in.messages, req.tools)
        param = "messages"
    else:
        prompt, param = req.prompt, "prompt"
    srv.check_prompt_chars(len(prompt), param)
    special = bool(req.add_special_tokens)
    try:
        ids = await asyncio.to_thread(srv.tokenizer.encode, prompt, special)
    except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates the Rust tokenizer refuses
        raise APIError(400, f"{param} could not be tokenized ({type(exc).__name__})", param=param) from None
    strs = [srv.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=srv.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(srv: ServerState, req: DetokenizeRequest) -> DetokenizeResponse:
    srv.check_model(req.model)
    _need_tokenizer(srv)
    # The cheap checks first (length, then max() at C speed); the first id out of range only when there is one.
    if req.tokens and max(req.tokens) >= srv.vocab_size:
        bad = next(t for t in req.tokens if t >= srv.vocab_size)
        raise APIError(400, f"tokens: {bad} is outside the vocabulary (0..{srv.vocab_size - 1})", param="tokens")
    if len(req.tokens) > srv.max_prompt_chars:
        raise APIError(400, f"tokens: at most {srv.max_prompt_chars} ids", param="tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(srv.tokenizer.decode, req.tokens, False))
