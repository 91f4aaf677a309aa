#!/usr/bin/env python3
"""Load test of a running `orinfer serve` (or any OpenAI-compatible server): throughput, TTFT and TPOT.

    orinfer serve -m DIR --port 8000 &
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1 8 64 --max-tokens 128 \
        --out benchmarks/serve.json

Workloads (`--workload`):
  uniform      for each concurrency level C, `--requests` streaming requests (default max(16, 4*C)), C at a time, each
               with the same prompt length and `ignore_eos` so every request generates exactly `--max-tokens` tokens.
               Per request: TTFT (send -> first generated text), TPOT ((last token time - first token time) /
               (tokens - 1)) and the end-to-end latency; per level, output tokens per second over the wall time, and
               the p50/p99 of each latency.
  multi-turn   `--conversations` chats at once, `--turns` turns each, all opening with the same `--system-words`
               prompt; each turn resends the whole conversation (as chat clients and agents do) plus `--user-words`
               new words and gets `--max-tokens` tokens. TTFT p50/p99 per turn: prefix caching shows in turns 2+.
  long-prompt  `--streams` requests stream `--stream-tokens` tokens each; once all are streaming, one prompt of
               `--long-words` words arrives. Its TTFT, and the largest gap between two tokens of a running stream
               while it is computed (and before it arrived, for reference): chunked prefill bounds that gap.

`--word-vocab N` makes prompts of random words "w<k>", k < N (the synthetic word-level tokenizer of
scripts/bench_serve_synthetic.py: one token per word, and distinct requests share no prefix by accident).
`--client-processes P` (uniform) sends a level from P processes: one Python client streaming 64 requests uses most of
a core, and its own delays then show in the TTFT it measures. Each level also prints the server's own TTFT and
queue quantiles and where the time went (engine busy share and mean step, CPU of engine, server and client) when
the server exports those metrics (`orinfer serve` does).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path

import httpx

WORDS = ("Alice was beginning to get very tired of sitting by her sister on the bank and of having nothing to do "
         "once or twice she had peeped into the book her sister was reading but it had no pictures or "
         "conversations in it").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    tpot: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    error: str = ""


@dataclass
class Level:
    concurrency: int
    requests: int
    failed: int
    wall_s: float
    output_tok_s: float
    requests_s: float
    ttft_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    e2e_ms: dict = field(default_factory=dict)
    # TTFT of each wave of `concurrency` requests in the order they were issued: the first wave arrives as one burst
    # (every prompt queued at once), the later ones as earlier requests finish, so the two show apart what a burst
    # and the steady state cost.
    ttft_ms_by_wave: list = field(default_factory=list)
    # The server's own view of the level's requests, from its /metrics histograms (bucket bounds, so p50 / p99 are
    # "at most"): time to first token and time waiting for admission, both from the engine's arrival. A client TTFT
    # far above the server's points outside the engine (HTTP, the engine process's pipe, the load generator).
    server_ms: dict = field(default_factory=dict)
    # Where the level's time went, from counters read before and after it: the engine's busy share of the wall time
    # and its mean step, and the CPU share used by the engine's process, the HTTP server's and this load generator
    # (1.0 = one core). A process near 1.0 with the engine far from busy is the bottleneck.
    load: dict = field(default_factory=dict)


WARMUP_REQUESTS = 4
SERVER_HISTOGRAMS = {"ttft": "orinfer_time_to_first_token_seconds", "queue": "orinfer_request_queue_time_seconds"}
SERVER_COUNTERS = {"steps": "orinfer_engine_steps_total", "step_s": "orinfer_engine_step_seconds_total",
                   "engine_cpu_s": "orinfer_engine_cpu_seconds_total", "server_cpu_s": "process_cpu_seconds_total"}


def histogram_buckets(metrics_text: str, name: str) -> dict[float, float]:
    """{upper bound: cumulative count} of histogram `name` in a Prometheus text page (empty if absent)."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith(name + "_bucket{"):
            bound, count = line.split('le="', 1)[1].split('"', 1)[0], line.rsplit(" ", 1)[1]
            out[float(bound)] = float(count)
    return out


def counter_value(metrics_text: str, name: str) -> float | None:
    """The value of unlabelled counter `name` in a Prometheus text page (None if absent)."""
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def load_shares(before: dict[str, float | None], after: dict[str, float | None], wall: float) -> dict:
    """`Level.load` from two snapshots of SERVER_COUNTERS (+ "client_cpu_s") taken `wall` seconds apart; the keys
    whose counters the server lacks are left out."""
    delta = {k: after[k] - before[k] for k in after if after.get(k) is not None and before.get(k) is not None}
    out: dict = {}
    if "step_s" in delta:
        out["engine_busy"] = round(delta["step_s"] / wall, 3)
        if delta.get("steps"):
            out["step_ms"] = round(delta["step_s"] / delta["steps"] * 1e3, 3)
    for key in ("engine_cpu_s", "server_cpu_s", "client_cpu_s"):
        if key in delta:
            out[key.removesuffix("_s")] = round(delta[key] / wall, 3)
    return out


def bucket_quantiles(before: dict[float, float], after: dict[float, float]) -> dict:
    """p50 / p99 (ms, as the upper bound of the bucket holding them) and the count of the observations made between
    two snapshots of one histogram."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    out: dict = {"count": int(total)}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        out[name] = next((round(b * 1e3, 1) for b, c in zip(bounds, counts) if total and c >= q * total), None)
    return out


async def server_snapshot(client: httpx.AsyncClient) -> tuple[dict[str, dict[float, float]], dict[str, float | None]]:
    """The SERVER_HISTOGRAMS' buckets ({} each when /metrics is unavailable: another server) and the SERVER_COUNTERS
    (None when absent) now, with this process's CPU time as "client_cpu_s"."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        text = ""
    counters = {key: counter_value(text, name) for key, name in SERVER_COUNTERS.items()}
    counters["client_cpu_s"] = time.process_time()
    return {key: histogram_buckets(text, name) for key, name in SERVER_HISTOGRAMS.items()}, counters


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    return {"p50": round(percentile(ms, 0.5), 3), "p99": round(percentile(ms, 0.99), 3),
            "mean": round(statistics.fmean(ms), 3) if ms else float("nan")}


def make_prompt(i: int, words: int, word_vocab: int | None = None) -> str:
    if word_vocab:
        return random_words(random.Random(i), words, word_vocab)
    body = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))
    return f"Request {i}: {body}"


def random_words(rng: random.Random, words: int, word_vocab: int) -> str:
    return " ".join(f"w{rng.randrange(1, word_vocab)}" for _ in range(words))


@dataclass
class Stream:
    """One streamed completion: when each piece of text arrived (perf_counter seconds) and the text."""

    sent: float
    times: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    cached_tokens: int = 0      # prompt tokens the server served from its prefix cache (usage.prompt_tokens_details)
    headers: float = 0.0        # when the response's status line and headers arrived (a streaming server sends them
                                # once it has accepted the request, before its first token)
    error: str = ""
    started: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    def gaps(self, start: float = float("-inf"), end: float = float("inf")) -> list[float]:
        """Gaps between consecutive pieces whose interval overlaps [start, end]."""
        return [b - a for a, b in zip(self.times, self.times[1:]) if b >= start and a <= end]


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                            temperature: float = 0.0, stream: Stream | None = None) -> Stream:
    """Streams one /v1/completions request (ignore_eos)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    return await stream_request(client, "/v1/completions", body, stream)


async def stream_request(client: httpx.AsyncClient, path: str, body: dict, stream: Stream | None = None) -> Stream:
    """POSTs a streaming request and records when each piece of text arrives; `error` says what went wrong."""
    out = stream or Stream(time.perf_counter())
    out.sent = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            out.headers = time.perf_counter()
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    return out
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                    out.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                text = ""
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    text += choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
                if text:
                    out.times.append(time.perf_counter())
                    out.text += text
                    out.started.set()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    if not out.error and not out.times:
        out.error = "no text received"
    return out


def _client(args: argparse.Namespace, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
    return httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits, timeout=httpx.Timeout(args.timeout))


async def multi_turn(args: argparse.Namespace, model: str) -> dict:
    """The multi-turn chat workload (see the module docstring): TTFT per turn."""
    vocab = args.word_vocab
    system = random_words(random.Random(1), args.system_words, vocab) if vocab else make_prompt(1, args.system_words)
    ttfts: list[list[float]] = [[] for _ in range(args.turns)]
    accepted: list[list[float]] = [[] for _ in range(args.turns)]     # request sent -> response headers
    cached: list[list[int]] = [[] for _ in range(args.turns)]
    failed = 0

    async def conversation(client: httpx.AsyncClient, index: int) -> None:
        nonlocal failed
        rng = random.Random(1000 + index)
        history = system
        for turn in range(args.turns):
            user = (random_words(rng, args.user_words, vocab) if vocab
                    else make_prompt(index * 10 + turn, args.user_words))
            history += " " + user
            reply = await stream_completion(client, model, history, args.max_tokens, args.temperature)
            if reply.error:
                failed += 1
                print(f"  failed: {reply.error}", file=sys.stderr)
                return
            ttfts[turn].append(reply.ttft)
            accepted[turn].append(reply.headers - reply.sent)
            cached[turn].append(reply.cached_tokens)
            history += reply.text

    start = time.perf_counter()
    async with _client(args, args.conversations) as client:
        before, counters_before = await server_snapshot(client)
        await asyncio.gather(*[conversation(client, i) for i in range(args.conversations)])
        after, counters_after = await server_snapshot(client)
    wall = time.perf_counter() - start
    turns = [{"turn": t + 1, "requests": len(v), "ttft_ms": summary(v), "headers_ms": summary(accepted[t]),
              "mean_cached_tokens": round(statistics.fmean(cached[t]), 1) if cached[t] else 0.0}
             for t, v in enumerate(ttfts)]
    later = [x for v in ttfts[1:] for x in v]
    return {"conversations": args.conversations, "turns": args.turns, "system_words": args.system_words,
            "user_words": args.user_words, "failed": failed, "wall_s": round(wall, 3), "per_turn": turns,
            "later_turns_ttft_ms": summary(later),
            # The server's own view of every turn together (its histograms count from its hand-off of a request):
            # a client TTFT well above it is time spent in HTTP or in this process.
            "server_ms": {key: bucket_quantiles(before[key], after[key]) for key in after if after[key]},
            "load": load_shares(counters_before, counters_after, wall)}


async def long_prompt(args: argparse.Namespace, model: str) -> dict:
    """The long-prompt-arrives workload (see the module docstring)."""
    vocab = args.word_vocab
    async with _client(args, args.streams + 1) as client:
        streams = [Stream(time.perf_counter()) for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream_completion(client, model, make_prompt(50_000 + i, args.prompt_words, vocab),
                                                       args.stream_tokens, args.temperature, stream))
                 for i, stream in enumerate(streams)]
        await asyncio.gather(*[s.started.wait() for s in streams])
        await asyncio.sleep(args.settle)
        prompt = random_words(random.Random(7), args.long_words, vocab) if vocab else make_prompt(7, args.long_words)
        long = await stream_completion(client, model, prompt, 16, args.temperature)
        await asyncio.gather(*tasks)
    errors = [s.error for s in streams + [long] if s.error]
    for error in errors[:1]:
        print(f"  failed: {error}", file=sys.stderr)
    if long.error:
        return {"failed": len(errors)}
    arrived, answered = long.sent, long.times[0]
    during = [g for s in streams for g in s.gaps(arrived, answered)]
    before = [g for s in streams for g in s.gaps(end=arrived)]
    return {"streams": args.streams, "stream_tokens": args.stream_tokens, "long_words": args.long_words,
            "failed": len(errors), "long_prompt_ttft_ms": round(long.ttft * 1000, 3),
            "max_gap_during_ms": round(max(during, default=0.0) * 1000, 3),
            "max_gap_before_ms": round(max(before, default=0.0) * 1000, 3),
            "gap_during_ms": summary(during), "gap_before_ms": summary(before)}


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, model: str, i: int) -> Result:
    prompt = make_prompt(i, args.prompt_words, args.word_vocab)
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if args.endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
        body["chat_template_kwargs"] = {"enable_thinking": False}
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    out = await stream_request(client, path, body)
    if out.error:
        return Result(False, error=out.error)
    tpot = (out.times[-1] - out.times[0]) / (out.tokens - 1) if out.tokens > 1 else 0.0
    return Result(True, ttft=out.ttft, tpot=tpot, e2e=time.perf_counter() - out.sent, tokens=out.tokens)


async def issue_requests(args: argparse.Namespace, model: str, indices: list[int], concurrency: int) -> list[Result]:
    """Requests `indices` (prompt numbers), `concurrency` at a time, on one connection pool; results in that order."""
    sem = asyncio.Semaphore(concurrency)
    async with _client(args, concurrency) as client:
        async def bounded(i: int) -> Result:
            async with sem:
                return await one_request(client, args, model, i)

        return await asyncio.gather(*[bounded(i) for i in indices])


def client_process(args: argparse.Namespace, model: str, indices: list[int], concurrency: int,
                   start_at: float) -> tuple[list[tuple], float, float, float]:
    """One load-generator process of `--client-processes`: its share of a level's requests, issued from `start_at`
    (time.perf_counter's clock, the host's monotonic one, so every process starts together). Returns the results as
    tuples (picklable across the spawn), its first send and last finish times, and its CPU seconds."""
    cpu = time.process_time()
    time.sleep(max(0.0, start_at - time.perf_counter()))
    begin = time.perf_counter()
    results = asyncio.run(issue_requests(args, model, indices, concurrency))
    return [astuple(r) for r in results], begin, time.perf_counter(), time.process_time() - cpu


async def _issue_in_processes(args: argparse.Namespace, model: str, indices: list[int], concurrency: int
                              ) -> tuple[list[Result], float, float]:
    """A level split over `args.client_processes` processes (request i to process i mod P, the concurrency shared
    out): a single Python client near a core of CPU delays its own sends and reads (run 344: 0.88 cores at c64, with
    client TTFT p99 798 ms where the server's was <= 250). Returns the results in `indices` order, the wall time
    from the first send to the last finish, and the processes' CPU seconds."""
    procs = min(args.client_processes, len(indices))
    shares = [indices[j::procs] for j in range(procs)]
    loop = asyncio.get_running_loop()
    start_at = time.perf_counter() + 2.0      # after the processes have started
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = await asyncio.gather(*[
            loop.run_in_executor(pool, client_process, args, model, share,
                                 concurrency // procs + (j < concurrency % procs), start_at)
            for j, share in enumerate(shares)])
    by_index = {i: Result(*r) for share, run in zip(shares, runs) for i, r in zip(share, run[0])}
    wall = max(run[2] for run in runs) - min(run[1] for run in runs)
    return [by_index[i] for i in indices], wall, sum(run[3] for run in runs)


async def run_level(args: argparse.Namespace, model: str, concurrency: int, offset: int,
                    requests: int | None = None) -> Level:
    n = requests or args.requests or max(16, 4 * concurrency)
    indices = [offset + i for i in range(n)]
    async with _client(args, 1) as client:
        before, counters_before = await server_snapshot(client)
        if getattr(args, "client_processes", 1) > 1 and concurrency > 1:
            results, wall, client_cpu = await _issue_in_processes(args, model, indices, concurrency)
        else:
            start = time.perf_counter()
            results = await issue_requests(args, model, indices, concurrency)
            wall, client_cpu = time.perf_counter() - start, 0.0
        after, counters_after = await server_snapshot(client)
    counters_after["client_cpu_s"] += client_cpu
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"  failed: {r.error}", file=sys.stderr)
            break
    tokens = sum(r.tokens for r in ok)
    waves = [[r.ttft for r in results[start:start + concurrency] if r.ok] for start in range(0, n, concurrency)]
    return Level(concurrency, n, len(results) - len(ok), round(wall, 3), round(tokens / wall, 2),
                 round(len(ok) / wall, 3), summary([r.ttft for r in ok]), summary([r.tpot for r in ok]),
                 summary([r.e2e for r in ok]), [summary(wave) for wave in waves if wave],
                 {key: bucket_quantiles(before[key], after[key]) for key in after if after[key]},
                 load_shares(counters_before, counters_after, wall))


async def main_async(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=30) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
    if args.warmup:
        # A few requests one at a time (not --requests of them: 512 x 128 tokens at batch 1 took minutes, which cut
        # NOTES runs 318, 319, 331 and 332 at their time limits before the measured level began).
        await run_level(args, model, 1, offset=10_000_000, requests=WARMUP_REQUESTS)
    common = {"url": args.url, "model": model, "workload": args.workload, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "host": platform.node(), "command": " ".join(sys.argv)}
    if args.workload == "multi-turn":
        return {**common, "multi_turn": await multi_turn(args, model)}
    if args.workload == "long-prompt":
        return {**common, "long_prompt": await long_prompt(args, model)}
    levels = []
    for c in args.concurrency:
        level = await run_level(args, model, c, offset=c * 100_000)
        print(f"concurrency {c:>3}: {level.output_tok_s:>9.1f} tok/s  TTFT p50 {level.ttft_ms['p50']:.1f} ms "
              f"p99 {level.ttft_ms['p99']:.1f} ms  TPOT p50 {level.tpot_ms['p50']:.2f} ms "
              f"p99 {level.tpot_ms['p99']:.2f} ms  ({level.requests} requests, {level.failed} failed)")
        print("  TTFT p50 / p99 ms by wave of requests: "
              + ", ".join(f"{w['p50']:.0f} / {w['p99']:.0f}" for w in level.ttft_ms_by_wave))
        if server := server_lines(asdict(level)):
            print(server)
        levels.append(level)
    return {"url": args.url, "model": model, "endpoint": args.endpoint, "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words, "temperature": args.temperature, "host": platform.node(),
            "command": " ".join(sys.argv), "levels": [asdict(level) for level in levels]}


def server_lines(result: dict) -> str:
    """A level's or workload's server quantiles and load shares (`server_ms`, `load`) as indented lines ("" without
    them: another server)."""
    lines = []
    if result.get("server_ms"):
        lines.append("  server (bucket bounds, from its arrival): " + ", ".join(
            f"{key} p50 <= {v['p50']} ms p99 <= {v['p99']} ms" for key, v in result["server_ms"].items()))
    if result.get("load"):
        lines.append("  load (busy share of the wall time; CPU in cores): "
                     + ", ".join(f"{key} {value}" for key, value in result["load"].items()))
    return "\n".join(lines)


def markdown(report: dict) -> str:
    if "multi_turn" in report:
        mt = report["multi_turn"]
        rows = ["| turn | requests | TTFT p50 ms | TTFT p99 ms | response headers p50 ms | cached prompt tokens (mean) |",
                "|---:|---:|---:|---:|---:|---:|"]
        rows += [f"| {t['turn']} | {t['requests']} | {t['ttft_ms']['p50']:.1f} | {t['ttft_ms']['p99']:.1f} | "
                 f"{t.get('headers_ms', {}).get('p50', float('nan')):.1f} | {t.get('mean_cached_tokens', 0):.0f} |"
                 for t in mt["per_turn"]]
        later, turns = mt.get("later_turns_ttft_ms"), mt["per_turn"][1:]
        if later and turns:  # the issue's multi-turn figure: TTFT p50 over every request after the first turn
            rows.append(f"| {turns[0]['turn']}-{turns[-1]['turn']} | {sum(t['requests'] for t in turns)} | "
                        f"{later['p50']:.1f} | {later['p99']:.1f} | | |")
        return "\n".join(rows + [line for line in [server_lines(mt)] if line])
    if "long_prompt" in report:
        lp = report["long_prompt"]
        if "long_prompt_ttft_ms" not in lp:
            return "failed"
        return ("| streams | long prompt words | long prompt TTFT ms | max gap while it is computed ms | "
                "max gap before ms |\n|---:|---:|---:|---:|---:|\n"
                f"| {lp['streams']} | {lp['long_words']} | {lp['long_prompt_ttft_ms']:.1f} | "
                f"{lp['max_gap_during_ms']:.1f} | {lp['max_gap_before_ms']:.1f} |")
    rows = ["| concurrency | requests | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in report["levels"]:
        rows.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['output_tok_s']:.1f} | {lv['requests_s']:.2f} "
                    f"| {lv['ttft_ms']['p50']:.1f} | {lv['ttft_ms']['p99']:.1f} | {lv['tpot_ms']['p50']:.2f} "
                    f"| {lv['tpot_ms']['p99']:.2f} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--workload", default="uniform", choices=["uniform", "multi-turn", "long-prompt"])
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"], help="uniform workload")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--requests", type=int, default=None, help="per level (default max(16, 4 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=200, help="prompt length in words (~1.3 tokens each)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--client-processes", type=int, default=1,
                   help="uniform workload: split each level over this many load-generator processes, so that the "
                        "client's own CPU does not add to the latencies it measures")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--word-vocab", type=int, default=None, help="prompts of random words w<k>, k < N")
    p.add_argument("--conversations", type=int, default=32, help="multi-turn")
    p.add_argument("--turns", type=int, default=4, help="multi-turn")
    p.add_argument("--system-words", type=int, default=2000, help="multi-turn: shared opening")
    p.add_argument("--user-words", type=int, default=50, help="multi-turn: new words per turn")
    p.add_argument("--streams", type=int, default=32, help="long-prompt: streams decoding")
    p.add_argument("--stream-tokens", type=int, default=512, help="long-prompt: tokens per stream")
    p.add_argument("--long-words", type=int, default=16000, help="long-prompt: the arriving prompt")
    p.add_argument("--settle", type=float, default=1.0, help="long-prompt: seconds of streaming before it arrives")
    p.add_argument("--out", default=None, help="write the report as JSON here (and a .md table beside it)")
    return p.parse_args(argv)


def write_report(report: dict, out: str | Path) -> None:
    """The JSON report at `out` and its markdown table (with the command) beside it."""
    out = Path(out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"`{report['command']}`\n\n{markdown(report)}\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(main_async(args))
    print(markdown(report))
    if args.out:
        write_report(report, args.out)
    failed = [lv["failed"] for lv in report.get("levels", [])]
    failed += [report[k].get("failed", 0) for k in ("multi_turn", "long_prompt") if k in report]
    return 1 if any(failed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
