"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand: no extra dependency.

Counters and histograms are updated from two threads (the event loop counts HTTP requests, the engine thread records
finished sequences), so every update takes one lock. Gauges that describe the engine (running and waiting sequences,
KV-cache blocks) are read from the engine loop's latest snapshot when the page is rendered.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Iterable

Labels = tuple[tuple[str, str], ...]

# Latency buckets (seconds): TTFT and end-to-end span milliseconds to minutes; time per output token is finer.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    items = list(labels) + ([extra] if extra else [])
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, lock: threading.Lock) -> None:
        self.name, self.help, self._lock = name, help_text, lock

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, lock: threading.Lock) -> None:
        super().__init__(name, help_text, lock)
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in items]


class Gauge(_Metric):
    """A value read when rendering (a callable), so it is never stale."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, lock: threading.Lock, read: Callable[[], float]) -> None:
        super().__init__(name, help_text, lock)
        self._read = read

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_fmt_value(float(self._read()))}"]


class CounterSnapshot(Gauge):
    """A counter kept by the engine thread (its published stats), read when rendering."""

    kind = "counter"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, lock: threading.Lock, buckets: Iterable[float]) -> None:
        super().__init__(name, help_text, lock)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)   # the last one is +Inf
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            return
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1
                    break
            else:
                self._counts[-1] += 1
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def render(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self._counts), self._sum, self._count
        lines = self.header()
        cumulative = 0
        for bound, c in zip(self.buckets + (math.inf,), counts):
            cumulative += c
            lines.append(f"{self.name}_bucket{_fmt_labels((), ('le', _fmt_value(bound)))} {cumulative}")
        lines.append(f"{self.name}_sum {_fmt_value(total)}")
        lines.append(f"{self.name}_count {count}")
        return lines


class ServerMetrics:
    """Every metric the server exports. `stats` returns the engine snapshot: a dict with running, waiting,
    free_blocks, num_blocks, alive, prefix_cache_queries, prefix_cache_hits."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        lock = threading.Lock()
        self._stats = stats
        p = "orinfer_"
        self.http_requests = Counter(p + "http_requests_total", "HTTP requests by route and status code.", lock)
        self.requests_finished = Counter(p + "request_success_total",
                                         "Finished sequences by finish reason (stop, length, abort, error).", lock)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of admitted sequences.", lock)
        self.generation_tokens = Counter(p + "generation_tokens_total", "Generated tokens.", lock)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first generated token.", lock,
                              LATENCY_BUCKETS)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time between output tokens of a sequence (after the first).", lock, TPOT_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish of a sequence.", lock,
                             LATENCY_BUCKETS)
        # (vLLM's name: the wait for admission, apart from the first step's own time in time_to_first_token.)
        self.queue = Histogram(p + "request_queue_time_seconds", "Arrival to the first step that runs the sequence.",
                               lock, LATENCY_BUCKETS)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens_total",
                                    "Speculative decoding: draft tokens verified.", lock)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens_total",
                                       "Speculative decoding: draft tokens the model accepted.", lock)
        self.verify_steps = Counter(p + "spec_decode_num_drafts_total",
                                    "Speculative decoding: steps that verified a sequence's drafts (per sequence).",
                                    lock)
        self._metrics: list[_Metric] = [
            self.http_requests, self.requests_finished, self.prompt_tokens, self.generation_tokens, self.ttft,
            self.tpot, self.e2e, self.queue, self.draft_tokens, self.accepted_tokens, self.verify_steps,
            Gauge(p + "num_requests_running", "Sequences in the running batch.", lock, lambda: self._stat("running")),
            Gauge(p + "num_requests_waiting", "Sequences waiting for a prefill (new or preempted).", lock,
                  lambda: self._stat("waiting")),
            Gauge(p + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", lock, self._usage),
            Gauge(p + "kv_cache_free_blocks", "Free KV-cache blocks.", lock, lambda: self._stat("free_blocks")),
            Gauge(p + "kv_cache_total_blocks", "KV-cache blocks in the pool.", lock, lambda: self._stat("num_blocks")),
            CounterSnapshot(p + "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", lock,
                            lambda: self._stat("prefix_cache_queries")),
            CounterSnapshot(p + "prefix_cache_hits_total", "Prompt tokens found in the prefix cache (K/V reused).", lock,
                            lambda: self._stat("prefix_cache_hits")),
            Gauge(p + "engine_alive", "1 while the engine loop runs, 0 once it died.", lock,
                  lambda: self._stat("alive")),
            CounterSnapshot(p + "engine_steps_total", "Engine steps run.", lock, lambda: self._stat("steps")),
            CounterSnapshot(p + "engine_step_seconds_total",
                            "Wall time spent in engine steps (the engine's busy time).", lock,
                            lambda: self._stat("step_seconds")),
            CounterSnapshot(p + "engine_cpu_seconds_total",
                            "CPU time of the process that runs the engine (the server's, without an engine process).",
                            lock, lambda: self._stat("cpu_seconds")),
            # Prometheus' standard name: this process's (the HTTP server's) user + system CPU time.
            CounterSnapshot("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", lock,
                            time.process_time),
        ]

    def _stat(self, key: str) -> float:
        return float(self._stats().get(key, 0))

    def _usage(self) -> float:
        s = self._stats()
        total = s.get("num_blocks", 0)
        return 1.0 - s.get("free_blocks", 0) / total if total else 0.0

    def observe_sequence(self, finish_reason: str, num_completion_tokens: int, arrival: float | None,
                         first_token: float | None, finish: float | None,
                         speculation: tuple[int, int, int] = (0, 0, 0), first_scheduled: float | None = None) -> None:
        """Called once per sequence when it finishes or is aborted (perf_counter timestamps). `speculation`: its draft
        tokens, accepted draft tokens and verify steps; `first_scheduled`: when a step first ran it."""
        self.requests_finished.inc(finish_reason=finish_reason)
        self.generation_tokens.inc(num_completion_tokens)
        drafted, accepted, steps = speculation
        if steps:
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            self.verify_steps.inc(steps)
        if finish_reason in ("abort", "error"):
            return  # a cancelled request's latencies would only describe the client
        if arrival is not None and first_token is not None:
            self.ttft.observe(first_token - arrival)
        if arrival is not None and first_scheduled is not None:
            self.queue.observe(first_scheduled - arrival)
        if first_token is not None and finish is not None and num_completion_tokens > 1:
            self.tpot.observe((finish - first_token) / (num_completion_tokens - 1))
        if arrival is not None and finish is not None:
            self.e2e.observe(finish - arrival)

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics:
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
