"""Prompt log-probabilities (SamplingParams.prompt_logprobs): the log-probability of each prompt token after the ones
before it, and the top-k there, computed from the hidden states of the prompt's own rows as its chunks run.

A prompt chunk covering positions [first, end) has, at the row of position p, the distribution of token p + 1. So a
chunk yields the entries of prompt tokens first + 1 .. end (those below the prompt's length); the first prompt token
has none (None). Such a sequence reads nothing from the prefix cache until its entries are complete (a cached block
would skip the rows they come from), and after a preemption the recomputed rows of tokens it already has are not
recomputed into entries again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from orinfer.engine.scheduler import StepPlan
from orinfer.engine.sequence import Sequence, TokenLogprob

# Prompt rows whose logits are computed at once: bounds the fp32 logits of a long chunk (512 x 152k x 4 B = 311 MB).
ROWS_PER_SLICE = 512


@dataclass
class PromptSpan:
    """Entries of `seq`'s prompt tokens [first_token, first_token + count), from flat rows starting at `row`."""

    seq: Sequence
    first_token: int
    count: int
    row: int


def prompt_spans(plan: StepPlan) -> list[PromptSpan]:
    """The prompt-logprob entries a step yields, per sequence that wants them (before the step advances counts)."""
    spans, row = [], 0
    for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
        if seq.params.prompt_logprobs is not None:
            first, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            lo, hi = max(first + 1, len(seq.prompt_logprobs)), min(end + 1, seq.num_prompt_tokens)
            if hi > lo:
                spans.append(PromptSpan(seq, lo, hi - lo, row + (lo - 1 - first)))
        row += num_new
    return spans


@dataclass
class PromptLogprobs:
    """A step's prompt entries on the device: [R] log-probabilities of the prompt tokens, [R, k] top ones."""

    logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor


def compute_prompt_logprobs(hidden: torch.Tensor, spans: list[PromptSpan],
                            logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                            upload: Callable[[list, torch.dtype], torch.Tensor]) -> PromptLogprobs:
    """The entries of `spans` from a step's hidden states [T, H]. `logits_of(hidden, rows)`: fp32 logits of those
    rows; `upload(values, dtype)`: a host list on the device. Top-k is the largest k any span's sequence asks for."""
    rows = [s.row + i for s in spans for i in range(s.count)]
    targets = [t for s in spans for t in s.seq.token_ids[s.first_token:s.first_token + s.count]]
    k = max(s.seq.params.prompt_logprobs for s in spans)
    rows_dev, targets_dev = upload(rows, torch.int64), upload(targets, torch.int64)
    lps, tops, ids = [], [], []
    for start in range(0, len(rows), ROWS_PER_SLICE):
        logp = torch.log_softmax(logits_of(hidden, rows_dev[start:start + ROWS_PER_SLICE]).float(), dim=-1)
        lps.append(logp.gather(1, targets_dev[start:start + ROWS_PER_SLICE, None]).squeeze(1))
        top_lp, top_id = logp.topk(k, dim=-1)
        tops.append(top_lp)
        ids.append(top_id)
    return PromptLogprobs(torch.cat(lps), torch.cat(tops), torch.cat(ids))


def record_prompt_logprobs(spans: list[PromptSpan], logprobs: list[float], top_logprobs: list[list[float]],
                           top_ids: list[list[int]]) -> None:
    """Appends a step's entries (host lists, rows in span order) to their sequences' `prompt_logprobs`."""
    row = 0
    for span in spans:
        seq = span.seq
        k = seq.params.prompt_logprobs
        for i in range(span.count):
            token = span.first_token + i
            if token == len(seq.prompt_logprobs):  # (a sequence aborted and gone keeps what it had)
                top = list(zip(top_ids[row + i][:k], top_logprobs[row + i][:k]))
                seq.prompt_logprobs.append(TokenLogprob(seq.token_ids[token], logprobs[row + i], top))
        row += span.count
