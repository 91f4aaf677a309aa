"""Nothing a client sends holds the server's event loop (issue 34), checked by structure rather than by timing: the
start-up heap is out of the collector's full passes (server and engine processes)."""

from __future__ import annotations

import functools
import gc
import logging
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from orinfer import LLM  # noqa: E402
from orinfer.server.heap import freeze_startup_heap  # noqa: E402


# --- the collector ----------------------------------------------------------------------------------------------------

def test_full_collections_skip_the_startup_heap():
    """What a full collection walks after `freeze_startup_heap` is what was made since, not the process's heap (in
    `orinfer serve`, 220,000 objects and 100-220 ms per pass before)."""
    before = len(gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        assert frozen > before // 2
        assert len(gc.get_objects()) < before // 10
    finally:
        gc.unfreeze()


def test_orinfer_serve_freezes_its_heap_before_it_serves(tiny_dir, monkeypatch):
    import uvicorn

    from orinfer.cli import main
    from orinfer.server import heap

    events = []
    monkeypatch.setattr(heap, "freeze_startup_heap", lambda: events.append("freeze") or 0)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: events.append("serve"))
    assert main(["serve", "-m", str(tiny_dir), "--device", "cpu", "--no-engine-process", "--port", "0"]) == 0
    assert events == ["freeze", "serve"]


def test_the_engine_process_freezes_its_heap_before_it_takes_requests(tiny_dir, monkeypatch):
    """`_engine_main` (the engine process's body, here in a thread over pipes) freezes once the engine is built,
    before it reports ready."""
    import multiprocessing

    from orinfer.server import engine_process

    events = []
    monkeypatch.setattr(engine_process, "freeze_startup_heap", lambda: events.append("freeze") or 0)
    inbox, to_engine = multiprocessing.Pipe(duplex=False)
    from_engine, outbox = multiprocessing.Pipe(duplex=False)
    factory = functools.partial(LLM, tiny_dir, dtype="float32", device="cpu", progress=False, max_model_len=256)
    child = threading.Thread(target=engine_process._engine_main, args=(factory, inbox, outbox, logging.WARNING),
                             daemon=True)
    child.start()
    try:
        assert from_engine.poll(120)
        assert from_engine.recv()[0] == "info" and events == ["freeze"]
    finally:
        to_engine.send(("stop",))
        child.join(30)
        # Its stats thread says "dead" once the loop has stopped: keep the pipe open until it has.
        for thread in threading.enumerate():
            if thread.name == "orinfer-engine-stats":
                thread.join(10)
