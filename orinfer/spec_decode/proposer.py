"""Draft proposers: each gives a decoding sequence up to k tokens for the next step to verify."""

from __future__ import annotations

from typing import Iterable, Protocol

from orinfer.engine.sequence import Sequence
from orinfer.errors import ConfigError
from orinfer.spec_decode.config import SpeculativeConfig
from orinfer.spec_decode.draft_model import DraftModelProposer
from orinfer.spec_decode.mtp import MTPProposer
from orinfer.spec_decode.ngram import TokenArrays, ngram_draft


class Proposer(Protocol):
    def propose_batch(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """For each sequence (all its tokens known on the host), up to rooms[i] draft tokens to follow them."""

    def keep_only(self, running: Iterable[Sequence]) -> None:
        """Drops what the proposer keeps for sequences no longer running."""


class NgramProposer:
    """Prompt lookup over the sequence's own tokens (spec_decode/ngram.py)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.arrays = TokenArrays()
        # Forced acceptance (benchmarks on random weights): a lookup that finds nothing still drafts k tokens (the
        # newest one repeated), so that every step verifies k drafts, as on text where the lookup keeps matching.
        self.always_draft = config.forced_acceptance is not None

    def propose_batch(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        return [self._propose(seq, room) for seq, room in zip(seqs, rooms)]

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        draft = ngram_draft(self.arrays.of(seq.seq_id, seq.token_ids), k, self.min_n, self.max_n)
        if not draft and self.always_draft:
            draft = [seq.last_token_id] * k
        return draft

    def keep_only(self, running: Iterable[Sequence]) -> None:
        self.arrays.keep_only({seq.seq_id for seq in running})


def make_proposer(config: SpeculativeConfig, draft: "DraftModelProposer | None" = None,
                  mtp: "MTPProposer | None" = None) -> Proposer:
    """The proposer of `config.method`; `draft`: the engine's draft-model proposer, if it loaded a draft model;
    `mtp`: its MTP proposer, if it was created with method mtp."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "draft_model":
        if draft is None:
            raise ConfigError("speculative_config: method 'draft_model' needs the draft model loaded with the engine "
                              "(LLM(..., speculative_config={'method': 'draft_model', 'model': DIR, ...}) does)")
        draft.k = config.num_speculative_tokens
        return draft
    if mtp is None:
        raise ConfigError("speculative_config: method 'mtp' needs the engine created with it (LLM(..., "
                          "speculative_config={'method': 'mtp', ...}) loads the MTP head and sizes its KV cache)")
    if config.num_speculative_tokens > mtp.k:
        raise ConfigError(f"speculative_config: num_speculative_tokens {config.num_speculative_tokens} exceeds the "
                          f"{mtp.k} the engine was created with")
    mtp.k, mtp.max_batch = config.num_speculative_tokens, config.max_batch
    return mtp
