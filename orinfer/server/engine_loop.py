"""One background thread owns the `LLMEngine`; HTTP requests talk to it through queues.

- The event loop submits work with `EngineLoop.submit(group)`: the group (one HTTP request: n sequences, or one per
  prompt and choice) goes into a thread-safe inbox. Only the engine thread calls the engine: `add_request`, `step`,
  `take_delta`, `abort`, `release`.
- The engine thread adds the group's sequences (all or none; a RequestError comes back as the `accepted` future's
  exception) - a request's images were decoded and resized by the server, so only their patches are made here -
  then steps the engine while anything is unfinished. After each step it hands each advanced sequence's new text,
  token logprobs and finish reason to its group's asyncio.Queue with `loop.call_soon_threadsafe` (one wake-up of
  the event loop per step); `RequestGroup.updates()` merges what queued up while a handler was busy.
- Cancellation: `group.abort()` (a client disconnected, a handler was cancelled or failed) puts an abort command in the
  inbox; the engine thread aborts the group's unfinished sequences before its next step, which frees their KV blocks.
  Aborting a finished group is a no-op, so handlers call it unconditionally in `finally`.
- When idle the thread blocks on the inbox (no spinning). If `step` raises, every in-flight request fails with an
  internal error and its sequences are aborted; three failed steps in a row mark the engine dead (/health -> 503).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from orinfer.engine.llm_engine import LLMEngine
from orinfer.engine.sequence import Sequence
# The group side lives in request_group; its names are re-exported here, where callers have always found them.
from orinfer.server.request_group import (EngineDeadError, EngineStepError, RequestGroup, SeqUpdate,  # noqa: F401
                                          deliver)

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3
# ORINFER_SLOW_STEP_MS=N: log (warning) every engine step, and every gap between two steps, longer than N ms, with the
# batch it ran: for finding where a serving run's long TTFTs come from. Unset: no timing at all.
SLOW_STEP_MS = float(os.environ.get("ORINFER_SLOW_STEP_MS", "0") or 0)


@dataclass
class _Tracked:
    group: RequestGroup
    index: int
    seq: Sequence
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False


class EngineLoop:
    """The engine thread. `start()` once; `stop()` aborts what runs and joins the thread."""

    def __init__(self, engine: LLMEngine, metrics: Any | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self._pending = 0                   # sequences submitted but not yet added by the engine thread
        self._pending_lock = threading.Lock()
        self._stats: dict[str, float] = {}
        self._last_step_end = 0.0           # (SLOW_STEP_MS) when the last step ended, 0 when it left no work
        # Totals for /metrics: steps run and their wall time (the engine's busy time; with the process's CPU time they
        # tell a serving run whose engine waits on HTTP from one whose engine is the bottleneck).
        self._steps = 0
        self._step_seconds = 0.0
        self._publish_stats()

    # --- event-loop side --------------------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None and not self._stopping

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        self._thread = threading.Thread(target=self._run, name="orinfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s", timeout)

    def submit(self, group: RequestGroup) -> None:
        """Queues a group; await `group.accepted` for the prompt lengths (or the engine's RequestError)."""
        if not self.alive:
            raise EngineDeadError(self.dead_message())
        group._engine_loop = self
        # Mark a rejection as retrieved even if the handler is gone by then (no "never retrieved" warnings).
        group.accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
        with self._pending_lock:
            self._pending += len(group.prompts)
        self._inbox.put(("add", group))

    def load(self) -> int:
        """Sequences in the engine or on their way to it (for admission control)."""
        return len(self._tracked) + self._pending

    def _abort(self, group: RequestGroup) -> None:
        self._inbox.put(("abort", group))

    def stats(self) -> dict[str, float]:
        """The latest snapshot published by the engine thread (running, waiting, free_blocks, num_blocks, alive)."""
        return {**self._stats, "alive": 1.0 if self.alive else 0.0}

    def dead_message(self) -> str:
        if self._stopping:
            return "the server is shutting down"
        if self.error is not None:
            return self._error_message()
        return "the engine loop is not running"

    def _error_message(self) -> str:
        return f"the engine stopped after an internal error ({type(self.error).__name__})"

    # --- engine thread ----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        try:
            while True:
                if self._drain(block=not self.engine.has_unfinished()):
                    break
                if self.engine.has_unfinished():
                    try:
                        self._step()
                        failures = 0
                    except Exception as exc:  # noqa: BLE001 - anything from the model: fail the requests, go on
                        failures += 1
                        log.exception("engine step failed (%d in a row)", failures)
                        if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                            # Dead: the handler below records the error before it fails the requests, so a client
                            # told of the failure already finds /health at 503 (failing them first was a race).
                            raise
                        self._fail_all(EngineStepError(f"internal engine error: {type(exc).__name__}"))
                self._publish_stats()
        except BaseException as exc:  # noqa: BLE001 - the loop is dead: say so to everyone waiting
            self.error = exc
            log.critical("the engine loop died: %r", exc)
            self._fail_all(EngineDeadError(self.dead_message()))
        else:
            self._fail_all(EngineDeadError("the server is shutting down"))
        finally:
            self._drain_after_death()
            self._publish_stats()

    def _drain(self, block: bool) -> bool:
        """Runs the queued commands; returns True when asked to stop."""
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            kind, group = cmd
            if kind == "stop":
                return True
            if kind == "add":
                self._add(group)
            elif kind == "abort":
                self._abort_group(group, "abort")
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return False

    def _add(self, group: RequestGroup) -> None:
        with self._pending_lock:
            self._pending -= len(group.prompts)
        added: list[Sequence] = []
        try:
            for seq_id, ids, params in zip(group.seq_ids, group.prompts, group.params):
                added.append(self.engine.add_request(ids, params, seq_id, images=group.images,
                                                     max_pixels=group.max_pixels, arrival_time=group.arrival))
        except Exception as exc:  # noqa: BLE001 - RequestError (-> 400) or anything else (-> 500), never fatal
            for seq in added:
                self.engine.abort(seq.request_id)
            self._to_loop(group, group._resolve, exc)
            return
        for i, seq in enumerate(added):
            self._tracked[seq.request_id] = _Tracked(group, i, seq)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
        self._to_loop(group, group._resolve, [seq.num_prompt_tokens for seq in added])

    def _abort_group(self, group: RequestGroup, reason: str) -> None:
        for seq_id in group.seq_ids:
            tracked = self._tracked.pop(seq_id, None)
            if tracked is None:
                continue  # finished already (and released), or never added
            self.engine.abort(seq_id)
            self.engine.release(seq_id)
            self._observe(tracked.seq, reason)

    def _step(self) -> None:
        # One wake-up of each event loop per step (not one per sequence): call_soon_threadsafe writes to a pipe.
        batches: dict[int, tuple[asyncio.AbstractEventLoop, list[tuple[RequestGroup, SeqUpdate]]]] = {}
        for seq in self._timed_step():
            tracked = self._tracked.get(seq.request_id)
            if tracked is None:
                continue
            text = self.engine.take_delta(seq)
            lps = seq.logprobs[tracked.sent_logprobs:] if seq.logprobs else []
            tracked.sent_logprobs += len(lps)
            prompt_lps = None
            if (seq.params.prompt_logprobs is not None and not tracked.sent_prompt_logprobs
                    and len(seq.prompt_logprobs) == seq.num_prompt_tokens):
                prompt_lps, tracked.sent_prompt_logprobs = list(seq.prompt_logprobs), True
            reason = seq.finish_reason if seq.is_finished else None
            if reason is not None:
                del self._tracked[seq.request_id]
                self.engine.release(seq.request_id)
                self._observe(seq, reason)
            elif not text and not lps and prompt_lps is None:
                continue
            group = tracked.group
            update = SeqUpdate(tracked.index, text, lps, seq.num_completion_tokens, reason,
                               seq.num_prompt_cached_tokens, prompt_lps)
            batches.setdefault(id(group.loop), (group.loop, []))[1].append((group, update))
        for loop, items in batches.values():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # the event loop is closed (server shut down): nobody is waiting
                pass

    def _timed_step(self) -> list[Sequence]:
        """`engine.step()`, counted in the step totals; logged too when SLOW_STEP_MS is set (see there)."""
        start = time.perf_counter()
        sched = self.engine.scheduler if SLOW_STEP_MS else None
        running, waiting = (len(sched.running), len(sched.waiting)) if sched is not None else (0, 0)
        advanced = self.engine.step()
        end = time.perf_counter()
        self._steps += 1
        self._step_seconds += end - start
        if not SLOW_STEP_MS:
            return advanced
        gap_ms = (start - self._last_step_end) * 1e3 if self._last_step_end else 0.0
        self._last_step_end = end if self.engine.has_unfinished() else 0.0  # (an idle wait is no gap)
        took_ms = (end - start) * 1e3
        if took_ms > SLOW_STEP_MS or gap_ms > SLOW_STEP_MS:
            log.warning("slow step at %.3f: %.1f ms (%.1f ms since the last one), %d running and %d waiting before "
                        "it, %d advanced", time.time(), took_ms, gap_ms, running, waiting, len(advanced))
        return advanced

    def _fail_all(self, error: BaseException) -> None:
        """Aborts every in-flight sequence and tells each group (once) why."""
        groups = {id(t.group): t.group for t in self._tracked.values()}
        for group in groups.values():
            try:
                self._abort_group(group, "error")
            except Exception:  # noqa: BLE001 - the engine may be broken; still tell the client
                log.exception("abort failed")
            self._to_loop(group, group.queue.put_nowait, error)
        self._tracked.clear()

    def _drain_after_death(self) -> None:
        """Rejects groups still in the inbox once the loop is gone."""
        while True:
            try:
                kind, group = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._pending_lock:
                    self._pending -= len(group.prompts)
                self._to_loop(group, group._resolve, EngineDeadError(self.dead_message()))

    def _observe(self, seq: Sequence, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_sequence(reason, seq.num_completion_tokens, seq.arrival_time, seq.first_token_time,
                                          seq.finish_time or time.perf_counter(),
                                          (seq.num_draft_tokens, seq.num_accepted_tokens, seq.num_verify_steps),
                                          seq.first_scheduled_time)

    @staticmethod
    def _to_loop(group: RequestGroup, fn: Any, arg: Any) -> None:
        try:
            group.loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the event loop is closed (server shut down): nobody is waiting
            pass

    def _publish_stats(self) -> None:
        bm, sched = self.engine.block_manager, self.engine.scheduler
        self._stats = {"running": float(len(sched.running)), "waiting": float(len(sched.waiting)),
                       "free_blocks": float(bm.num_free_blocks), "num_blocks": float(bm.num_blocks),
                       "tracked": float(len(self._tracked)), "prefix_cache_queries": float(bm.num_queried_tokens),
                       "prefix_cache_hits": float(bm.num_hit_tokens), "steps": float(self._steps),
                       "step_seconds": self._step_seconds, "cpu_seconds": time.process_time()}
