"""Token log-probabilities in the OpenAI formats: each token's text and UTF-8 bytes (from its byte-level BPE piece,
cached per id), chat's `logprobs.content` entries and the completions API's parallel lists."""

from __future__ import annotations

from typing import Any

from orinfer.engine.sequence import TokenLogprob
from orinfer.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprobEntry, TopLogprob


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


def clean_logprob(lp: float) -> float:
    return lp if lp == lp and lp > -9999.0 else -9999.0   # JSON has no -inf / NaN


class LogprobFormatter:
    """Formats the engine's TokenLogprobs with one tokenizer's pieces."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(text, UTF-8 bytes) of one token; a piece that is part of a multi-byte character shows U+FFFD."""
        cached = self._cache.get(token_id)
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
            if len(self._cache) < 1_000_000:
                self._cache[token_id] = cached
        return cached

    def chat(self, lps: list[TokenLogprob]) -> ChatLogprobs:
        entries = []
        for lp in lps:
            text, raw = self.token(lp.token_id)
            top = [TopLogprob(token=self.token(t)[0], logprob=clean_logprob(v), bytes=self.token(t)[1])
                   for t, v in lp.top]
            entries.append(TokenLogprobEntry(token=text, logprob=clean_logprob(lp.logprob), bytes=raw,
                                             top_logprobs=top))
        return ChatLogprobs(content=entries)

    def prompt(self, prompt_ids: list[int], entries: list[TokenLogprob | None] | None) -> CompletionLogprobs:
        """The completions API's lists for an echoed prompt (OpenAI's `echo` with `logprobs`): every prompt token,
        from text offset 0, with its entry; the first token's log-probability and top are null (nothing predicts
        it). `entries`: the engine's prompt log-probabilities (None: the prompt tokens with null entries)."""
        known = [e for e in entries or [] if e is not None]
        first = len(prompt_ids) - len(known)
        out = self.completion(known, sum(len(self.token(t)[0]) for t in prompt_ids[:first]))
        head = [self.token(t)[0] for t in prompt_ids[:first]]
        offsets = [sum(len(h) for h in head[:i]) for i in range(first)]
        return CompletionLogprobs(tokens=head + out.tokens, token_logprobs=[None] * first + out.token_logprobs,
                                  top_logprobs=[None] * first + out.top_logprobs,
                                  text_offset=offsets + out.text_offset)

    def completion(self, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        """The completions API's lists. Each `top_logprobs` entry holds the sampled token first, then the `logprobs`
        most likely ones (up to logprobs + 1 entries, as OpenAI documents and vLLM returns): with `logprobs: 0` it is
        {sampled token: its logprob}, never an empty dict."""
        out = CompletionLogprobs()
        for lp in lps:
            text = self.token(lp.token_id)[0]
            value = clean_logprob(lp.logprob)
            out.tokens.append(text)
            out.token_logprobs.append(value)
            top = {text: value}
            for t, v in lp.top:
                top.setdefault(self.token(t)[0], clean_logprob(v))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out
