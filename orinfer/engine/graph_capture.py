"""One rule every CUDA-graph capture of the engine follows: no Python garbage collection while a stream captures.

A collection can run at any Python allocation. If it frees an unreachable CUDA graph of an earlier engine (a test's,
or one released by a rebuild), the graph's destructor resets it, which CUDA forbids during a capture ("operation not
permitted when stream is capturing"), and the capture in progress fails. `torch.cuda.graph` collects once before it
starts capturing; `capture_graph` keeps the collector off until the capture has ended (GPU run 311: an MTP-graphs test
failed with that warning after 20 others in one process, and passed alone).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, pool=None, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool, stream)` with Python's cyclic garbage collector paused for the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
    finally:
        if enabled:
            gc.enable()
