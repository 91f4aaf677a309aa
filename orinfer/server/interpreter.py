"""Interpreter settings that keep a server process's event loop responsive: the garbage collector's full passes, and
how soon a busy worker thread hands the interpreter lock back.

- `freeze_startup_heap`: CPython's oldest-generation collection walks every container object the process holds.
  After start-up that is the whole of torch, pydantic, FastAPI and the tokenizer (over 200,000 objects in `orinfer
  serve` with a tiny model), and the collector runs such a pass whenever enough new objects have survived: request
  traffic of any kind (a burst of malformed bodies will do) triggers one every second or so. Measured on the CPU load
  test (2 cores, a loop-lag monitor in the server): full collections of 100-220 ms on the event loop thread, its
  longest stalls. `gc.freeze()` moves everything alive at start-up into a permanent generation that collections skip,
  so they walk only what requests created since. Start-up objects live as long as the process anyway; a frozen object
  that later becomes garbage is still freed by reference counting, only a reference cycle among them would stay.
- `shorten_switch_interval`: a thread waiting for the interpreter lock gets it from a running thread only after
  `sys.getswitchinterval()`, 5 ms by default. The event loop gives the lock up at every system call (epoll, send,
  recv), and while a worker thread is busy (parsing or validating a large body, rendering, tokenizing, building a
  response) the loop waits up to that long to get it back, several times per request it serves. Measured on the
  load test's hostile part (2 cores, one of them busy elsewhere): /health p99 119-211 ms at 5 ms, 30-54 ms at 1 ms;
  the full mix 310-361 ms against 168-223 ms.
"""

from __future__ import annotations

import gc
import sys

SWITCH_INTERVAL_S = 0.001


def freeze_startup_heap() -> int:
    """Collects what start-up left behind, then freezes the rest out of future collections; returns how many objects
    were frozen. Call it once a process has loaded everything it serves with, before it takes traffic."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def shorten_switch_interval() -> None:
    """Lets a thread waiting for the interpreter lock (the event loop) have it after SWITCH_INTERVAL_S instead of
    5 ms. The process-wide cost is more frequent switching between busy threads: a few per cent of their throughput."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
