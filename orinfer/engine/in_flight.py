"""A launched engine step whose sampled ids are still on the device (the engine's one-step lookahead).

Lookahead ("async scheduling"): while the device runs decode step N, the host launches step N+1, whose input ids are
step N's sampled ids gathered on the device; only then does it wait for step N's ids and process them (append, stop
checks, detokenize). The device then never idles between decode steps for the host's per-step work.

The ids reach the host through copies queued right behind the step's sampler, into pinned memory, with an event
recorded after them: waiting on that event waits for step N only. A plain `.tolist()` at resolve time would be queued
behind step N+1 as well and wait for it, which would undo the overlap. (A greedy decode graph writes its ids into
pinned memory itself, `SamplerOutput.host_token_ids`: then only the event is queued.)
"""

from __future__ import annotations

import dataclasses

import torch

from orinfer.engine.model_runner import DeferredSample
from orinfer.engine.prompt_logprobs import PromptSpan
from orinfer.engine.sequence import Sequence
from orinfer.layers.sampler import SamplerOutput


@dataclasses.dataclass
class HostSample:
    """A step's sampler output as host lists (None where the step computed no log-probabilities)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[float]] | None
    top_ids: list[list[int]] | None
    prompt_logprobs: list[float] | None = None        # the step's prompt entries (InFlightStep.spans), in order
    prompt_top_logprobs: list[list[float]] | None = None
    prompt_top_ids: list[list[int]] | None = None
    num_accepted: list[int] | None = None             # a verify step: row i's accepted drafts (token_ids are lists)

    def tokens_of(self, row: int) -> list[int]:
        """The tokens row `row` emits, in order: one, or after a verify step its accepted drafts and one more."""
        if self.num_accepted is None:
            return [self.token_ids[row]]
        return self.token_ids[row][:self.num_accepted[row] + 1]


class InFlightStep:
    """One launched step: the sequences that sample in it (row i samples for seqs[i]), those that ran prompt tokens
    in it, when it was launched, and its device outputs."""

    def __init__(self, seqs: list[Sequence], prompt_seqs: list[Sequence], start: float,
                 out: SamplerOutput | DeferredSample, spans: list[PromptSpan] | None = None) -> None:
        self.seqs, self.prompt_seqs, self.start = seqs, prompt_seqs, start
        self.spans = spans or []             # the prompt log-probability entries this step computes
        # A forward queued without its sampler (structured outputs: masks wait for the previous step's tokens);
        # `sampled` finishes it. Until then no step may be launched behind this one.
        self.deferred = out if isinstance(out, DeferredSample) else None
        if self.deferred is None:
            self.sampled(out)

    def sampled(self, out: SamplerOutput) -> None:
        """The step's sampler output, queued on the device: copies to the host start behind it."""
        self.deferred = None
        self.verifies = out.num_accepted is not None  # a verify step: no lookahead behind it (inputs unknown)
        self.device_ids = out.token_ids        # a lookahead step launched behind this one reads its inputs here
        self.device_accepted = out.num_accepted  # a verify step's accepted counts (a proposal queued behind it)
        host = {f.name: _to_host(getattr(out, f.name)) for f in dataclasses.fields(out)
                if f.name not in ("token_ids", "host_token_ids")}
        ids = out.host_token_ids if out.host_token_ids is not None else _to_host(out.token_ids)
        self._host = SamplerOutput(token_ids=ids, **host)
        self._event = None
        self._sample: HostSample | None = None
        if out.token_ids.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def rows_of(self, batch: list[Sequence]) -> list[int] | None:
        """For each sequence of `batch`, its row in this step; None when one of them was not in this step (its
        input id is not among this step's samples)."""
        index = {id(seq): i for i, seq in enumerate(self.seqs)}
        rows = [index.get(id(seq)) for seq in batch]
        return None if any(r is None for r in rows) else rows

    def wait(self) -> HostSample:
        """Blocks until this step's outputs are on the host (not longer: later steps may still run). A second call
        returns the same lists."""
        assert self.deferred is None, "a step waits for its tokens before it was sampled"
        if self._sample is not None:
            return self._sample
        if self._event is not None:
            self._event.synchronize()
        h = self._host

        def lists(t: torch.Tensor | None) -> list | None:
            return None if t is None else t.tolist()

        self._sample = HostSample(h.token_ids.tolist(), lists(h.logprobs), lists(h.top_logprobs), lists(h.top_ids),
                                  lists(h.prompt_logprobs), lists(h.prompt_top_logprobs), lists(h.prompt_top_ids),
                                  lists(h.num_accepted))
        return self._sample


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or not t.is_cuda:
        return t
    dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return dst.copy_(t, non_blocking=True)
