"""A request's state inside the engine: its tokens, where their KV lives, and how far it has got."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from orinfer.engine.multimodal import MultimodalInputs
from orinfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not in the KV cache (new, or preempted and to be recomputed)
    RUNNING = "running"      # admitted: holds KV blocks; prefilling (in chunks) or decoding
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


_ids = itertools.count()


class Sequence:
    """One prompt and its continuation. `block_table` lists the KV-cache blocks holding its tokens, in order."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, generator: torch.Generator | None = None,
                 mm: MultimodalInputs | None = None) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)   # known tokens only (on the host)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens sampled by launched steps whose ids are still on the device (0 or 1; 2 briefly inside a lookahead
        # step): they count in num_tokens, so positions, slots and blocks of the next step are right before the ids
        # reach the host, but not in token_ids / num_completion_tokens, which callers read.
        self.num_pending = 0
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # Hybrid models: the slot of the linear-attention state pools this sequence owns while it holds blocks (-1:
        # none; engine/block_manager.py hands them out).
        self.state_slot = -1
        # Hybrid models with prefix caching: the state snapshot a prefix-cache hit resumes from, to be copied into the
        # state slot before the sequence's first step (-1: none pending).
        self.restore_snapshot = -1
        # Prefix-cache hashes of the token ids' first full blocks, computed once (tokens only ever get appended), and
        # how many of the block table's blocks are registered under them.
        self.block_chain: list[bytes] = []
        self.num_committed_blocks = 0
        # Leading tokens whose K/V launched steps have written (or the prefix cache had): the next step runs tokens
        # from here. A decoding sequence has computed all but its newest token.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0            # leading tokens whose K/V came from the prefix cache at admission
        self.num_prompt_cached_tokens = 0     # the same at the first admission (reported in the output)
        self.finish_reason: str | None = None
        self.output_text = ""          # detokenized completion, stop strings removed
        self.emitted_chars = 0         # how much of output_text has been streamed
        self.logprobs: list[TokenLogprob] = []
        # Prompt log-probabilities (params.prompt_logprobs): one entry per prompt token computed so far, the first
        # token's None (nothing predicts it). engine/prompt_logprobs.py fills it.
        self.prompt_logprobs: list[TokenLogprob | None] = [None] if params.prompt_logprobs is not None else []
        self.num_preemptions = 0
        # timings (time.perf_counter seconds)
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.prefill_seconds = 0.0
        # The end of the prefill time counted so far: under lookahead a chunk's step is launched before the previous
        # chunk's resolves, and only the part of its span after that counts (the union of the spans, not their sum).
        self.prefill_counted_until = 0.0
        self.detokenizer = None        # set by the engine
        self.mm = mm                   # images of the prompt (Qwen3-VL), None for text
        self.thinking = None           # engine/thinking.py ThinkingBudget when the request has a thinking budget
        self.vision_seconds = 0.0      # time in the vision tower (again after a preemption's recompute)
        # Structured outputs: orinfer.structured.constraint.SequenceConstraint (set by the engine; None once finished)
        self.constraint = None
        # Speculative decoding: draft tokens after the newest token, which the next step verifies (set just before
        # scheduling, cleared when that step is processed), and the counts behind the acceptance metrics.
        self.draft_token_ids: list[int] = []
        self.num_draft_tokens = 0        # drafted and verified so far
        self.num_accepted_tokens = 0     # of which the target accepted
        self.num_verify_steps = 0        # steps that verified drafts
        self.num_draft_computed = 0      # leading tokens whose K/V a draft model's cache holds (draft_model method)

    @property
    def num_tokens(self) -> int:
        """Tokens including the pending ones: what the KV cache holds or a launched step will write."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next steps must still run before this sequence samples again (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Whether its next step is a plain decode row: one token, past the prompt (an M-RoPE sequence then sits at
        index + delta on every axis; a last prompt token may not)."""
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether its prompt must be computed, not read from the prefix cache: its prompt log-probabilities come
        from the prompt's own rows and are not all there yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def rope_delta(self) -> int:
        """Offset of this sequence's rotary position from its token index after the prompt (M-RoPE: images take
        fewer positions than tokens); 0 for text."""
        return 0 if self.mm is None else self.mm.delta

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def row_token_ids(self, first: int, end: int) -> list[int]:
        """Token ids of positions [first, end): known tokens, then draft tokens (0 for a pending token)."""
        known = self.token_ids[first:end]
        if end <= len(self.token_ids) or not self.draft_token_ids:
            return known
        drafts_from = max(0, first - len(self.token_ids))
        return known + self.draft_token_ids[drafts_from:drafts_from + end - first - len(known)]

    def blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        n = self.num_tokens if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def resolve_pending(self, token_id: int) -> None:
        """The oldest pending token's id reached the host."""
        assert self.num_pending > 0, "no token pending"
        self.num_pending -= 1
        self.token_ids.append(token_id)
