"""The event-loop side of one HTTP request: `RequestGroup` (its sequences' prompts, params and images, and one queue
of `SeqUpdate`s that the engine thread fills), and the errors the engine thread reports through it.

`RequestGroup.updates()` merges the updates that are already queued when its consumer comes back (text and
logprobs joined per sequence): a stream that falls behind under load catches up with one chunk per sequence instead
of one per token, and the concatenated result is the same.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from orinfer.engine.sequence import TokenLogprob
from orinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from orinfer.server.engine_loop import EngineLoop


class EngineDeadError(RuntimeError):
    """The engine loop stopped (it failed, or the server is shutting down): no request can be served."""


class EngineStepError(RuntimeError):
    """A step failed while this request was running; the request was aborted."""


@dataclass
class SeqUpdate:
    """What one engine step (or several, merged) produced for one sequence of a group."""

    index: int                          # the choice index inside the group
    text: str                           # new text (stop-string prefixes held back until they resolve)
    logprobs: list[TokenLogprob]        # log-probabilities of the tokens generated since the last update
    num_completion_tokens: int
    finish_reason: str | None           # "stop" | "length" | "abort" when the sequence ended
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    # Prompt log-probabilities (SamplingParams.prompt_logprobs), once, in the first update after they are complete.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def then(self, later: "SeqUpdate") -> "SeqUpdate":
        """This update followed by a later one of the same sequence, as one update."""
        return SeqUpdate(self.index, self.text + later.text, self.logprobs + later.logprobs,
                         later.num_completion_tokens, later.finish_reason, later.num_cached_tokens,
                         self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs)


class RequestGroup:
    """One HTTP request's sequences: prompts (token ids), params, and the images every prompt of the group shows
    (sources for the engine's `add_request`, one per <|image_pad|>), plus one queue for their updates."""

    _ids = itertools.count()

    def __init__(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams], *,
                 images: list[Any] | None = None, max_pixels: int | None = None) -> None:
        if len(prompts) != len(params) or not prompts:
            raise ValueError("one SamplingParams per prompt, at least one")
        self.request_id = request_id
        # (perf_counter: CLOCK_MONOTONIC, one clock for the server's and the engine's processes) The engine's latency
        # metrics count from here, the hand-off, as vLLM's count from its frontend: the wait for the engine thread
        # (a step in progress) and the engine process's pipe are in them.
        self.arrival = time.perf_counter()
        self.prompts, self.params = prompts, params
        self.images, self.max_pixels = images or None, max_pixels
        self.seq_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[SeqUpdate | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future[list[int]] = self.loop.create_future()
        self._engine_loop: EngineLoop | None = None
        self._remaining = len(prompts)
        self._aborted = False

    @property
    def done(self) -> bool:
        return self._remaining == 0

    def abort(self) -> None:
        """Stops the group's unfinished sequences (idempotent; a no-op once all finished)."""
        if self._aborted or self._remaining == 0 or self._engine_loop is None:
            return
        self._aborted = True
        self._engine_loop._abort(self)

    async def updates(self) -> AsyncIterator[SeqUpdate]:
        """Yields updates until every sequence finished; raises what the engine thread reported.

        Everything queued when the consumer asks again is taken at once and merged per sequence (in the order the
        sequences first appear): the last update's token count and finish reason, all the text and logprobs."""
        while self._remaining > 0:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            merged: dict[int, SeqUpdate] = {}
            error: BaseException | None = None
            for item in items:
                if isinstance(item, BaseException):
                    error = item  # nothing of this group follows an error
                    break
                earlier = merged.get(item.index)
                merged[item.index] = item if earlier is None else earlier.then(item)
            for update in merged.values():
                if update.finish_reason is not None:
                    self._remaining -= 1
                yield update
            if error is not None:
                self._remaining = 0
                raise error

    # --- called on the event loop by the engine thread (through call_soon_threadsafe) -------------------------------

    def _resolve(self, result: list[int] | BaseException) -> None:
        if self.accepted.done():
            return
        if isinstance(result, BaseException):
            self._remaining = 0
            self.accepted.set_exception(result)
        else:
            self.accepted.set_result(result)


def deliver(items: list[tuple[RequestGroup, SeqUpdate]]) -> None:
    """Runs on the event loop: puts one engine step's updates into their groups' queues."""
    for group, update in items:
        group.queue.put_nowait(update)
