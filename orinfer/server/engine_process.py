"""The engine in a process of its own, so that the API server's event loop never waits for the engine's interpreter.

In one process the event loop (HTTP, JSON, tokenizing, thousands of streamed chunks a second) and the engine thread
(scheduling, kernel launches, detokenizing) take turns on one interpreter lock: a prompt step's launch holds it for
tens of milliseconds, and the loop's queue of chunks and new requests waits. `EngineProcess` runs the unchanged
`EngineLoop` in a child process (spawned: CUDA is never initialised in the server process) and offers the server the
same surface (`submit`, `load`, `stats`, `alive`, ...). One pipe each way carries pickled messages:

  server -> engine   ("add", group id, prompts, params, images, max_pixels, arrival) | ("abort", group id, sequences)
                     | ("stop",)
  engine -> server   ("info", EngineInfo) once ready | ("resolve", group id, prompt lengths or an error)
                     | ("updates", [(group id, SeqUpdate), ...]) one per engine step | ("fail", group id, error)
                     | ("metric", method, args) | ("stats", dict) | ("dead", message)

In the child, each group is a `_RemoteGroup` whose event-loop callbacks become messages; in the server, a receiver
thread turns messages back into calls on the real `RequestGroup`s' event loops.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from orinfer.server.engine_loop import EngineLoop
from orinfer.server.interpreter import freeze_startup_heap
from orinfer.server.request_group import EngineDeadError, RequestGroup, deliver

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25


@dataclass
class EngineInfo:
    """What the server checks requests against (read from the engine once it is built)."""

    max_model_len: int
    vocab_size: int
    multimodal: bool
    kv_capacity: int          # tokens the KV cache holds
    image_processor: Any      # orinfer.multimodal.ImageProcessor, or None


def engine_info(engine: Any) -> EngineInfo:
    cfg = engine.parts.model_config
    return EngineInfo(engine.max_model_len, cfg.vocab_size, bool(cfg.is_multimodal),
                      engine.block_manager.num_blocks * engine.config.block_size, engine.parts.image_processor)


# --- the engine process -----------------------------------------------------------------------------------------------

class _Relay:
    """Child side: sends messages to the server (one writer at a time)."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def send(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)


class _RelayLoop:
    """Child side: stands in for the server's event loop. `call_soon_threadsafe(fn, arg)` runs fn(arg) at once, and
    fn sends; one engine step's updates (all groups share this loop) go as one message."""

    def __init__(self, relay: _Relay) -> None:
        self.relay = relay

    def call_soon_threadsafe(self, fn: Callable[[Any], None], arg: Any) -> None:
        if fn is deliver:
            self.relay.send(("updates", [(group.gid, update) for group, update in arg]))
        else:
            fn(arg)


class _RemoteGroup:
    """Child side: what `EngineLoop` needs of a `RequestGroup`; its event-loop callbacks become messages."""

    def __init__(self, loop: _RelayLoop, gid: int, prompts: list, params: list | None = None, images: Any = None,
                 max_pixels: Any = None, arrival: float | None = None) -> None:
        self.relay, self.gid, self.loop = loop.relay, gid, loop
        self.prompts, self.params, self.images, self.max_pixels = prompts, params, images, max_pixels
        self.arrival = arrival    # the server's RequestGroup.arrival (perf_counter's clock is the host's)
        self.seq_ids = [f"g{gid}-{i}" for i in range(len(prompts))]
        self.queue = self         # `queue.put_nowait(error)`: a failure of the group

    def _resolve(self, result: Any) -> None:
        self.relay.send(("resolve", self.gid, _picklable(result) if isinstance(result, BaseException) else result))

    def put_nowait(self, error: BaseException) -> None:
        self.relay.send(("fail", self.gid, _picklable(error)))


def _picklable(error: BaseException) -> BaseException:
    """`error` itself when it crosses the pipe intact (orinfer's errors do), else a RuntimeError saying what it was:
    a failed send would otherwise count as a failed engine step."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")


class _MetricsRelay:
    """Child side: the metrics calls EngineLoop makes, forwarded to the server's ServerMetrics."""

    def __init__(self, relay: _Relay) -> None:
        self.relay = relay
        self.prompt_tokens = self

    def inc(self, amount: float = 1.0) -> None:
        self.relay.send(("metric", "prompt_tokens", (amount,)))

    def observe_sequence(self, *args: Any) -> None:
        self.relay.send(("metric", "observe_sequence", args))


def _engine_main(factory: Callable[[], Any], inbox: Any, outbox: Any, log_level: int) -> None:
    """The child process: build the LLM, report its EngineInfo, run the EngineLoop on the server's messages."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    relay = _Relay(outbox)
    try:
        llm = factory()
        engine = llm.engine
        engine.allow_local_files = False  # the server decodes images itself; the engine never reads a path
        loop = EngineLoop(engine, metrics=_MetricsRelay(relay))
        # The model and its libraries stay for the life of the process: a full collection that walked them all
        # would stall the engine's steps for a tenth of a second (server/interpreter.py).
        freeze_startup_heap()
        loop.start()
        relay.send(("info", engine_info(engine)))
    except BaseException as exc:  # noqa: BLE001 - report why the engine could not start, then exit
        relay.send(("dead", f"the engine failed to start: {type(exc).__name__}: {exc}"))
        raise
    relay_loop = _RelayLoop(relay)

    def publish_stats() -> None:
        while loop.alive:
            relay.send(("stats", loop.stats()))
            time.sleep(STATS_INTERVAL_S)
        relay.send(("dead", loop.dead_message()))

    threading.Thread(target=publish_stats, name="orinfer-engine-stats", daemon=True).start()
    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):  # the server is gone
            break
        kind = message[0]
        if kind == "stop":
            break
        if kind == "add":
            _, gid, prompts, params, images, max_pixels, arrival = message
            loop._inbox.put(("add", _RemoteGroup(relay_loop, gid, prompts, params, images, max_pixels, arrival)))
        elif kind == "abort":  # (gid, number of sequences): aborting needs only the sequence ids
            loop._inbox.put(("abort", _RemoteGroup(relay_loop, message[1], [None] * message[2])))
    loop.stop()


# --- the server side -------------------------------------------------------------------------------------------------

class EngineProcess:
    """`EngineLoop`'s server-side surface over an engine in a child process. `factory()` (picklable: a module-level
    function or a functools.partial of one) builds the `LLM` in the child; `tokenizer` is the same tokenizer, for the
    server's own use. The constructor waits until the engine is built (`info`) or raises RuntimeError."""

    def __init__(self, factory: Callable[[], Any], tokenizer: Any, start_timeout: float = 1800.0) -> None:
        self.tokenizer = tokenizer
        self.metrics: Any | None = None
        self.error: BaseException | None = None
        self._stopping = False
        self._groups: dict[int, tuple[RequestGroup, int]] = {}   # id -> (group, unfinished sequences)
        self._next_gid = 0
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stats: dict[str, float] = {}
        ctx = mp.get_context("spawn")
        engine_reader, self._to_engine = ctx.Pipe(duplex=False)
        self._from_engine, engine_writer = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_engine_main, name="orinfer-engine", daemon=True,
                                    args=(factory, engine_reader, engine_writer, logging.getLogger().level))
        self._process.start()
        engine_reader.close()
        engine_writer.close()
        first = self._recv(start_timeout)
        if first is None or first[0] != "info":
            self._process.kill()
            reason = first[1] if first is not None and first[0] == "dead" else "no answer"
            raise RuntimeError(f"the engine process did not start ({reason})")
        self.info: EngineInfo = first[1]
        self._receiver = threading.Thread(target=self._receive, name="orinfer-engine-receiver", daemon=True)
        self._receiver.start()

    def _recv(self, timeout: float) -> tuple | None:
        if not self._from_engine.poll(timeout):
            return None
        try:
            return self._from_engine.recv()
        except (EOFError, OSError):
            return None

    # --- EngineLoop's surface ---

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping and self._process.is_alive()

    def start(self) -> None:
        """The engine runs from construction on (the server needs its EngineInfo first): nothing to do."""

    def stop(self, timeout: float = 30.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._send(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._process.kill()
        self._fail_all(EngineDeadError("the server is shutting down"))

    def submit(self, group: RequestGroup) -> None:
        if not self.alive:
            raise EngineDeadError(self.dead_message())
        group._engine_loop = self
        group.accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
        with self._lock:
            gid = self._next_gid
            self._next_gid += 1
            self._groups[gid] = (group, len(group.prompts))
        group._remote_id = gid
        self._send(("add", gid, group.prompts, group.params, group.images, group.max_pixels, group.arrival))

    def load(self) -> int:
        with self._lock:
            return sum(remaining for _, remaining in self._groups.values())

    def _abort(self, group: RequestGroup) -> None:
        self._forget(group._remote_id)  # its handler is gone: later updates are dropped, it no longer loads us
        self._send(("abort", group._remote_id, len(group.prompts)))

    stats = EngineLoop.stats
    dead_message = EngineLoop.dead_message

    def _error_message(self) -> str:
        return str(self.error)

    # --- plumbing ---

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._to_engine.send(message)
        except (OSError, ValueError):  # the pipe is closed: the receiver reports the death
            pass

    def _receive(self) -> None:
        """The receiver thread: engine messages to the groups' event loops, until the engine is gone."""
        while True:
            try:
                message = self._from_engine.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "updates":
                self._on_updates(message[1])
            elif kind == "resolve":
                self._on_resolve(message[1], message[2])
            elif kind == "fail":
                entry = self._forget(message[1])
                if entry is not None:
                    _call(entry.loop, entry.queue.put_nowait, message[2])
            elif kind == "metric":
                if self.metrics is not None:
                    method = getattr(self.metrics, message[1])
                    (method.inc if message[1] == "prompt_tokens" else method)(*message[2])
            elif kind == "stats":
                self._stats = message[1]
            elif kind == "dead":
                self.error = EngineDeadError(message[1])
                break
        if self.error is None:
            self.error = EngineDeadError("the engine process exited")
        if not self._stopping:
            log.critical("the engine process died: %s", self.error)
        self._fail_all(EngineDeadError(self.dead_message()))

    def _on_resolve(self, gid: int, result: Any) -> None:
        with self._lock:
            entry = self._groups.get(gid)
            if entry is None:
                return
            group = entry[0]
            if isinstance(result, BaseException):
                del self._groups[gid]
        _call(group.loop, group._resolve, result)

    def _on_updates(self, items: list[tuple[int, Any]]) -> None:
        by_loop: dict[int, tuple[Any, list]] = {}
        with self._lock:
            for gid, update in items:
                entry = self._groups.get(gid)
                if entry is None:
                    continue
                group, remaining = entry
                if update.finish_reason is not None:
                    remaining -= 1
                    if remaining:
                        self._groups[gid] = (group, remaining)
                    else:
                        del self._groups[gid]
                by_loop.setdefault(id(group.loop), (group.loop, []))[1].append((group, update))
        for loop, batch in by_loop.values():
            _call(loop, deliver, batch)

    def _forget(self, gid: int) -> RequestGroup | None:
        with self._lock:
            entry = self._groups.pop(gid, None)
        return None if entry is None else entry[0]

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            groups = [group for group, _ in self._groups.values()]
            self._groups.clear()
        for group in groups:
            _call(group.loop, group._resolve, error)
            _call(group.loop, group.queue.put_nowait, error)


def _call(loop: Any, fn: Callable[[Any], None], arg: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the event loop is closed (server shut down): nobody is waiting
        pass
