#!/usr/bin/env python3
"""Load test of a running `orinfer serve` (or any OpenAI-compatible server): throughput, TTFT and TPOT.

    orinfer serve -m DIR --port 8000 &
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1 8 64 --max-tokens 128 \
        --out benchmarks/serve.json

For each concurrency level C it sends `--requests` streaming requests (default max(16, 4*C)), C at a time, each with
the same prompt length and `ignore_eos` so every request generates exactly `--max-tokens` tokens. Per request it
measures TTFT (send -> first generated text), TPOT ((last token time - first token time) / (tokens - 1)) and the
end-to-end latency; per level, output tokens per second over the wall time, and the p50/p99 of each latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
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


def make_prompt(i: int, words: int) -> str:
    body = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))
    return f"Request {i}: {body}"


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, model: str, i: int) -> Result:
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if args.endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": make_prompt(i, args.prompt_words)}]
        body["chat_template_kwargs"] = {"enable_thinking": False}
    else:
        path = "/v1/completions"
        body["prompt"] = make_prompt(i, args.prompt_words)
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    text = choice.get("text") or delta.get("content") or delta.get("reasoning_content")
                    if text:
                        now = time.perf_counter()
                        first = first if first is not None else now
                        last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if first is None:
        return Result(False, error="no text received")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return Result(True, ttft=first - start, tpot=tpot, e2e=end - start, tokens=tokens)


async def run_level(args: argparse.Namespace, model: str, concurrency: int, offset: int) -> Level:
    n = args.requests or max(16, 4 * concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        async def bounded(i: int) -> Result:
            async with sem:
                return await one_request(client, args, model, offset + i)

        start = time.perf_counter()
        results = await asyncio.gather(*[bounded(i) for i in range(n)])
        wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"  failed: {r.error}", file=sys.stderr)
            break
    tokens = sum(r.tokens for r in ok)
    return Level(concurrency, n, len(results) - len(ok), round(wall, 3), round(tokens / wall, 2),
                 round(len(ok) / wall, 3), summary([r.ttft for r in ok]), summary([r.tpot for r in ok]),
                 summary([r.e2e for r in ok]))


async def main_async(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=30) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
    if args.warmup:
        await run_level(args, model, 1, offset=10_000_000)
    levels = []
    for c in args.concurrency:
        level = await run_level(args, model, c, offset=c * 100_000)
        print(f"concurrency {c:>3}: {level.output_tok_s:>9.1f} tok/s  TTFT p50 {level.ttft_ms['p50']:.1f} ms "
              f"p99 {level.ttft_ms['p99']:.1f} ms  TPOT p50 {level.tpot_ms['p50']:.2f} ms "
              f"p99 {level.tpot_ms['p99']:.2f} ms  ({level.requests} requests, {level.failed} failed)")
        levels.append(level)
    return {"url": args.url, "model": model, "endpoint": args.endpoint, "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words, "temperature": args.temperature, "host": platform.node(),
            "command": " ".join(sys.argv), "levels": [asdict(level) for level in levels]}


def markdown(report: dict) -> str:
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
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--requests", type=int, default=None, help="per level (default max(16, 4 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=200, help="prompt length in words (~1.3 tokens each)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
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
    return 1 if any(lv["failed"] for lv in report["levels"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
