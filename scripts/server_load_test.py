#!/usr/bin/env python3
"""Mixed hostile load against a real `orinfer serve` on loopback; exits 1 when a requirement of issue 34 fails.

    python3 scripts/server_load_test.py                     # builds a tiny Qwen3-VL model, full mix, ~2 minutes
    python3 scripts/server_load_test.py --model DIR --out load.json
    python3 scripts/server_load_test.py --scale 0.05 --no-latency-checks   # the smoke test's size

The server runs as users run it (`python -m orinfer serve`, the engine in its child process, CPU) with a short read
deadline and small image limits so that the mix fits in minutes. While `/health` is polled every 50 ms, at once:
streaming chats (a quarter of them disconnect after a few chunks), slow clients that send half a request head or half
a body and then nothing, prompts at the size limits (a body of --max-body-bytes, a prompt of the character limit),
image requests at the per-request pixel budget, and malformed bodies. Checked afterwards:

- no response with a 5xx status, and the server's own `/metrics` counts none;
- `/health` latency p99 under 200 ms; no gap over 1 s between two chunks of a running stream (on this tiny model the
  engine's own steps take milliseconds, so such a gap would be the server stalling);
- slow clients are cut off (by --request-read-timeout) and every other request gets an answer;
- once idle, every KV-cache block is free and the resident memory of the server and its engine process is within
  20% of what it was before the load (after a warm-up that loaded every code path once).

Latency checks can be turned off (--no-latency-checks) for runs on a machine too small or busy to mean anything.
Traffic goes to 127.0.0.1 only; every loop is bounded in count and the whole run in time (--time-limit).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import logging
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("server_load_test")

HOST = "127.0.0.1"
READ_TIMEOUT_S = 4.0            # the server's --request-read-timeout during the run
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 4 * 1024 * 1024
CHAT = "/v1/chat/completions"
KINDS = ["streams", "slow", "big-prompts", "big-images", "hostile"]


@dataclass
class Report:
    statuses: dict[str, int] = field(default_factory=dict)       # "kind status" -> count
    server_5xx: float = 0.0
    health_ms_p50: float = 0.0
    health_ms_p99: float = 0.0
    health_ms_max: float = 0.0
    health_failures: int = 0
    largest_stream_gap_ms: float = 0.0
    streams_finished: int = 0
    streams_disconnected: int = 0
    slow_clients_cut_off: int = 0
    slow_clients_held: int = 0
    rss_before_mb: float = 0.0
    rss_after_mb: float = 0.0
    free_blocks: float = 0.0
    total_blocks: float = 0.0
    seconds: float = 0.0
    tracebacks_logged: int = 0
    failures: list[str] = field(default_factory=list)

    def count(self, kind: str, status: int | str) -> None:
        key = f"{kind} {status}"
        self.statuses[key] = self.statuses.get(key, 0) + 1


# --- the server under test -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, log_file: Any, image_pixels: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "orinfer", "serve", "-m", str(model), "--host", HOST, "--port", str(port),
           "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--request-read-timeout", str(READ_TIMEOUT_S),
           "--max-image-pixels", str(image_pixels), "--max-request-image-pixels", str(2 * image_pixels),
           "--max-body-bytes", str(MAX_BODY_BYTES), "--served-model-name", "m", "--uvicorn-log-level", "warning"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log_file)


def rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants (the server and its engine process), in MB."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total


def metric(text: str, name: str, code_prefix: str | None = None) -> float:
    """Sum of a Prometheus metric's samples (optionally those whose code label starts with `code_prefix`)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        if code_prefix is not None and f'code="{code_prefix}' not in line:
            continue
        total += float(line.rsplit(" ", 1)[1])
    return total


# --- request bodies --------------------------------------------------------------------------------------------------

def png_data_url(width: int, height: int, seed: int) -> str:
    """A smooth (so compressible: the body stays small) RGB PNG of width x height as a data URL."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 255 // width), (y * 255 // height), np.full_like(x, seed * 37 % 256)], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(text: str, max_tokens: int, stream: bool = False, images: list[str] = ()) -> dict[str, Any]:
    content: Any = text
    if images:
        content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in images]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, "temperature": 0.8}


HOSTILE: list[bytes] = [
    b'{"messages": [', b"[1, 2]", b'"text"', b"{}", b'{"messages": []}', b'{"messages": "hi"}',
    b'{"messages": [{"role": "wizard", "content": "x"}]}', b'{"messages": [{"role": "user", "content": "x"}], "n": -1}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e309}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
    b'{"messages": [{"role": "user", "content": "x"}], "n": 100000}',
    b'{"messages": [{"role": "user", "content": "x"}], "stop": ["' + b"a" * 5000 + b'"]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}}'
    b"]}]}",
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,'
    b'AAAA"}}]}]}',
    b"[" * 100_000 + b"]" * 100_000,
    '{"messages": [{"role": "user", "content": "\udc80"}]}'.encode("utf-8", "surrogatepass"),
    # A body at the size limit of two million invalid token ids (before the server counted values, pydantic's error
    # for each held the event loop for a minute), and 20,000 text parts (within the value limit: walked in a worker).
    b'{"messages": [{"role": "user", "content": "x"}], "stop_token_ids": ['
    + b",".join([b"-1"] * ((MAX_BODY_BYTES - 100) // 3)) + b"]}",
    b'{"messages": [{"role": "user", "content": [' + b",".join([b'{"type": "text", "text": "x"}'] * 20_000) + b"]}]}",
]


def has_text(data: str) -> bool:
    """Whether an SSE data payload is a chunk carrying generated text (not the role chunk, a finish or [DONE])."""
    if data.strip() == "[DONE]":
        return False
    choices = json.loads(data).get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


def poll_health(port: int, stop: Any, results: Any) -> None:
    """GET /health every 50 ms until `stop` is set; sends the latencies (ms) and the failure count to `results`.
    Runs in a process of its own: in the load generator's event loop it would time that loop, not the server."""
    import http.client

    latencies, failures = [], 0
    while not stop.is_set():
        start = time.perf_counter()
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=10)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
        except OSError:
            ok = False
        latencies.append((time.perf_counter() - start) * 1000)
        failures += not ok
        time.sleep(0.05)
    results.send((latencies, failures))


# --- the load --------------------------------------------------------------------------------------------------------

class Load:
    def __init__(self, base: str, scale: float, seed: int, image_pixels: int) -> None:
        import httpx

        self.base = base
        self.rng = random.Random(seed)
        self.report = Report()
        self.scale = scale
        self.image_side = int(image_pixels ** 0.5)
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        self.http = httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(120.0), limits=limits)

    def n(self, full: int) -> int:
        return max(1, round(full * self.scale))

    async def stream(self, i: int, gate: asyncio.Semaphore) -> None:
        """A streaming chat; a quarter leave after a few chunks. Records the gaps between chunks while it runs."""
        leave_after = self.rng.randint(1, 6) if self.rng.random() < 0.25 else None
        body = chat_body(f"Tell me a story number {i}.", self.rng.randint(8, 48), stream=True)
        async with gate:
            try:
                async with self.http.stream("POST", CHAT, json=body) as r:
                    self.report.count("stream", r.status_code)
                    if r.status_code != 200:
                        await r.aread()
                        return
                    last, chunks = None, 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            self.report.largest_stream_gap_ms = max(self.report.largest_stream_gap_ms,
                                                                    (now - last) * 1000)
                        if last is not None or has_text(line[6:]):
                            last = now  # gaps count from the first token: waiting for a batch slot is not a stall
                        chunks += 1
                        if leave_after is not None and chunks >= leave_after:
                            self.report.streams_disconnected += 1
                            return  # leaving the `with` closes the connection mid-stream
                    self.report.streams_finished += 1
            except Exception as exc:  # noqa: BLE001 - a transport error is a result to report, not a crash
                self.report.count("stream", type(exc).__name__)

    async def slow_client(self, i: int) -> None:
        """Half a request (head only, or head and half a body), then silence: the server must hang up."""
        reader, writer = await asyncio.open_connection(HOST, int(self.base.rsplit(":", 1)[1]))
        body = json.dumps(chat_body("slow", 4)).encode()
        head = (f"POST {CHAT} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n").encode()
        writer.write(head if i % 2 == 0 else head + b"\r\n" + body[: len(body) // 2])
        await writer.drain()
        try:
            await asyncio.wait_for(reader.read(), timeout=READ_TIMEOUT_S + 10)
            self.report.slow_clients_cut_off += 1
        except asyncio.TimeoutError:
            self.report.slow_clients_held += 1
        finally:
            writer.close()

    async def post(self, kind: str, content: bytes | dict[str, Any]) -> None:
        try:
            if isinstance(content, dict):
                r = await self.http.post(CHAT, json=content)
            else:
                r = await self.http.post(CHAT, content=content, headers={"Content-Type": "application/json"})
            self.report.count(kind, r.status_code)
        except Exception as exc:  # noqa: BLE001
            self.report.count(kind, type(exc).__name__)

    def big_prompts(self) -> list:
        """Prompts at the limits: a whole --max-body-bytes body, and a prompt of the character limit."""
        filler = "ab " * ((MAX_BODY_BYTES - 200) // 3)
        at_char_limit = "ab " * (16 * MAX_MODEL_LEN // 3)
        bodies = [chat_body(filler if k % 2 == 0 else at_char_limit, 4) for k in range(self.n(4))]
        return [self.post("big-prompt", b) for b in bodies]

    def big_images(self) -> list:
        side = self.image_side
        bodies = [chat_body("Describe both.", 4, images=[png_data_url(side, side, 2 * k), png_data_url(side, side,
                                                                                                         2 * k + 1)])
                  for k in range(self.n(4))]
        return [self.post("big-image", b) for b in bodies]

    async def run(self, streams: int, slow: int, hostile_rounds: int, only: list[str]) -> None:
        gate = asyncio.Semaphore(100)
        parts = {"streams": lambda: [self.stream(i, gate) for i in range(self.n(streams))],
                 "slow": lambda: [self.slow_client(i) for i in range(self.n(slow))],
                 "big-prompts": self.big_prompts, "big-images": self.big_images,
                 "hostile": lambda: [self.post("hostile", b) for _ in range(self.n(hostile_rounds)) for b in HOSTILE]}
        tasks = [t for name, make in parts.items() if name in only for t in make()]
        self.rng.shuffle(tasks)
        await asyncio.gather(*tasks)

    async def warm_up(self) -> None:
        """One request down every path, so the memory measured before the load includes what a first use loads."""
        side = self.image_side
        await self.post("warm-up", chat_body("hello", 8))
        await self.post("warm-up", chat_body("look", 4, images=[png_data_url(side, side, 99)]))
        await self.post("big-prompt", chat_body("ab " * (16 * MAX_MODEL_LEN // 3), 4))


async def wait_idle(http: Any, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = (await http.get("/metrics")).text
        busy = metric(text, "orinfer_num_requests_running") + metric(text, "orinfer_num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.2)


async def drive(base: str, pid: int, args: argparse.Namespace) -> Report:
    load = Load(base, args.scale, args.seed, args.image_pixels)
    await load.warm_up()
    await wait_idle(load.http)
    await asyncio.sleep(1.0)
    before = rss_mb(pid)
    ctx = multiprocessing.get_context("spawn")
    stop, (receive, send) = ctx.Event(), ctx.Pipe(duplex=False)
    poller = ctx.Process(target=poll_health, args=(int(base.rsplit(":", 1)[1]), stop, send), daemon=True)
    poller.start()
    start = time.perf_counter()
    await load.run(args.streams, args.slow_clients, args.hostile_rounds, args.only)
    report = load.report
    report.seconds = time.perf_counter() - start
    stop.set()
    health_ms, report.health_failures = await asyncio.to_thread(receive.recv)
    poller.join(10)
    await wait_idle(load.http)
    await asyncio.sleep(2.0)
    text = (await load.http.get("/metrics")).text
    report.rss_before_mb, report.rss_after_mb = before, rss_mb(pid)
    report.free_blocks = metric(text, "orinfer_kv_cache_free_blocks")
    report.total_blocks = metric(text, "orinfer_kv_cache_total_blocks")
    report.server_5xx = metric(text, "orinfer_http_requests_total", code_prefix="5")
    ms = sorted(health_ms)
    if ms:
        report.health_ms_p50 = ms[len(ms) // 2]
        report.health_ms_p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        report.health_ms_max = ms[-1]
    await load.http.aclose()
    return report


def judge(report: Report, latency_checks: bool) -> None:
    f = report.failures
    fivexx = {k: v for k, v in report.statuses.items() if k.split()[-1].startswith("5")}
    if fivexx or report.server_5xx:
        f.append(f"5xx responses: {fivexx}, server counted {report.server_5xx:.0f}")
    errors = {k: v for k, v in report.statuses.items() if not k.split()[-1].isdigit()}
    if errors:
        f.append(f"requests that got no HTTP answer: {errors}")
    # Well-formed requests are served; the prompts at the limits and malformed bodies are refused with a 4xx.
    expected = {"warm-up": ("200",), "stream": ("200",), "big-image": ("200",), "big-prompt": ("400", "413"),
                "hostile": ("400", "413", "415", "422")}
    wrong = {k: v for k, v in report.statuses.items() if k.split()[-1] not in expected[k.split()[0]]}
    if wrong:
        f.append(f"unexpected statuses: {wrong}")
    if report.slow_clients_held:
        f.append(f"{report.slow_clients_held} slow clients were still connected {READ_TIMEOUT_S + 10:.0f} s later")
    if report.tracebacks_logged:
        f.append(f"the server logged {report.tracebacks_logged} tracebacks")
    if report.health_failures:
        f.append(f"/health failed {report.health_failures} times")
    if report.free_blocks != report.total_blocks:
        f.append(f"KV blocks not freed: {report.free_blocks:.0f} of {report.total_blocks:.0f} free")
    if report.rss_after_mb > 1.2 * report.rss_before_mb:
        f.append(f"RSS {report.rss_before_mb:.0f} MB before, {report.rss_after_mb:.0f} MB after (over +20%)")
    if latency_checks:
        if report.health_ms_p99 >= 200:
            f.append(f"/health p99 {report.health_ms_p99:.0f} ms (limit 200)")
        if report.largest_stream_gap_ms > 1000:
            f.append(f"largest gap in a running stream {report.largest_stream_gap_ms:.0f} ms (limit 1000)")


def build_model(out: Path) -> Path:
    from orinfer.tiny import make_tiny

    return make_tiny(out, arch="qwen3-vl", train_steps=0, progress=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a Qwen3-VL model dir (default: build a tiny one)")
    p.add_argument("--streams", type=int, default=300)
    p.add_argument("--slow-clients", type=int, default=100)
    p.add_argument("--image-pixels", type=int, default=1024 * 1024,
                   help="--max-image-pixels of the server; each image request carries two images of this size")
    p.add_argument("--hostile-rounds", type=int, default=4, help="times each malformed body is sent")
    p.add_argument("--only", nargs="+", default=KINDS, choices=KINDS, help="parts of the mix to run (default: all)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every count (at least 1 of each)")
    p.add_argument("--latency-checks", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds before the run is abandoned")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    with tempfile.TemporaryDirectory(prefix="orinfer-load-") as tmp:
        model = args.model or build_model(Path(tmp) / "tiny-vl")
        port = free_port()
        server_log = open(Path(tmp) / "server.log", "w+")
        server = start_server(model, port, server_log, args.image_pixels)
        try:
            base = f"http://{HOST}:{port}"
            wait_started(base, server, server_log)
            report = asyncio.run(asyncio.wait_for(drive(base, server.pid, args), args.time_limit))
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
        server_log.seek(0)
        report.tracebacks_logged = server_log.read().count("Traceback")
        server_log.close()
    judge(report, args.latency_checks)
    text = json.dumps(asdict(report), indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    for failure in report.failures:
        log.error("FAILED: %s", failure)
    return 1 if report.failures else 0


def wait_started(base: str, server: subprocess.Popen, server_log: Any, timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            server_log.seek(0)
            raise RuntimeError(f"orinfer serve exited with {server.returncode}: {server_log.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("orinfer serve did not answer /health in time")


if __name__ == "__main__":
    sys.exit(main())
