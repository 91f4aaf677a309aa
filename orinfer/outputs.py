"""What `LLM.generate` returns for each request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orinfer.engine.sequence import Sequence, TokenLogprob

if TYPE_CHECKING:
    from orinfer.tool_calls.types import ToolCall


@dataclass
class RequestMetrics:
    """Timings of one request, in seconds and tokens per second (as the seed's reports print them)."""

    num_prompt_tokens: int
    num_generated_tokens: int
    ttft_s: float | None          # arrival -> first generated token
    prefill_tok_s: float | None   # prompt tokens / the union of the spans of the steps that ran them, vision excluded
    decode_tok_s: float | None    # tokens after the first / time from the first token to the last
    e2e_s: float | None           # arrival -> finish
    num_preemptions: int = 0
    vision_encode_ms: float | None = None  # time in the vision tower (requests with images), else None
    # Speculative decoding: draft tokens verified, how many the model accepted, and the steps that verified some.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted share of the draft tokens (None without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify step: the accepted drafts plus the token after them (None without verify steps)."""
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else None

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        # The vision tower runs inside the prefill step but is reported on its own (as the seed does): the prefill
        # rate is the decoder's.
        decoder_prefill = seq.prefill_seconds - seq.vision_seconds
        prefill = seq.num_prompt_tokens / decoder_prefill if decoder_prefill > 0 else None
        decode = None
        if seq.finish_time is not None and seq.first_token_time is not None and seq.num_completion_tokens > 1:
            span = seq.finish_time - seq.first_token_time
            decode = (seq.num_completion_tokens - 1) / span if span > 0 else None
        e2e = None if seq.finish_time is None else seq.finish_time - seq.arrival_time
        vision = seq.vision_seconds * 1000 if seq.mm is not None else None
        return cls(seq.num_prompt_tokens, seq.num_completion_tokens, ttft, prefill, decode, e2e, seq.num_preemptions,
                   vision, seq.num_draft_tokens, seq.num_accepted_tokens, seq.num_verify_steps)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None       # "stop" (EOS, stop id or stop string), "length", "abort"; None while running
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0      # prompt tokens whose K/V came from the prefix cache (as vLLM reports them)
    # Set by LLM.chat (None / empty from generate): the answer split as the server splits it, i.e. the reasoning
    # (<think>), the text outside the tool calls, and the parsed calls (see orinfer/tool_calls).
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list["ToolCall"] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first None), else None.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def of(cls, seq: Sequence) -> "RequestOutput":
        return cls(seq.request_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], seq.output_text,
                   seq.completion_token_ids, seq.finish_reason, RequestMetrics.of(seq), list(seq.logprobs),
                   seq.num_prompt_cached_tokens,
                   prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None)
