"""The server with its engine in a child process (`EngineProcess`, what `orinfer serve` runs): the same answers as the
engine in a thread, streamed and not, n > 1, a request the engine refuses, a client that leaves mid-stream (its blocks
freed), metrics, and a dead engine (503, not a hang)."""

from __future__ import annotations

import functools
import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from orinfer import LLM  # noqa: E402
from orinfer.args import EngineArgs  # noqa: E402
from orinfer.server.app import ServerLimits, build_app  # noqa: E402
from orinfer.server.cli import BackgroundServer  # noqa: E402
from orinfer.server.engine_process import EngineProcess  # noqa: E402

ALICE = "Alice was beginning to get very"
SETTINGS = EngineArgs(dtype="float32", device="cpu", progress=False, num_kv_blocks=256)


@pytest.fixture(scope="module")
def servers(tiny_dir):
    """(engine in a child process, engine in a thread) over the same model."""
    process = EngineProcess(functools.partial(LLM, tiny_dir, SETTINGS), LLM.load_tokenizer(tiny_dir, SETTINGS))
    thread = LLM(tiny_dir, SETTINGS)
    with BackgroundServer(build_app(process, "tiny", limits=ServerLimits(max_tokens=64))) as remote, \
            BackgroundServer(build_app(thread, "tiny", limits=ServerLimits(max_tokens=64))) as local:
        yield remote, local, process


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)


def _stream_text(server, body: dict) -> tuple[str, dict]:
    text, usage = "", {}
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return text, usage


def test_same_answers_as_the_engine_in_a_thread(servers):
    remote, local, _ = servers
    body = {"prompt": ALICE, "max_tokens": 16, "temperature": 0}
    want = _post(local, "/v1/completions", body).json()
    got = _post(remote, "/v1/completions", body).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["text"].startswith(" tired of sitting")
    assert got["usage"] == want["usage"]
    text, usage = _stream_text(remote, body)
    assert text == want["choices"][0]["text"] and usage["completion_tokens"] == 16
    chat = {"messages": [{"role": "user", "content": "Who is Alice?"}], "max_tokens": 12, "temperature": 0.7,
            "seed": 3, "n": 2}
    want_chat = _post(local, "/v1/chat/completions", chat).json()
    got_chat = _post(remote, "/v1/chat/completions", chat).json()
    assert [c["message"] for c in got_chat["choices"]] == [c["message"] for c in want_chat["choices"]]


def test_new_request_fields_cross_the_process_boundary(servers):
    """Prompt logprobs (echo + logprobs), logit_bias and the thinking budget come back the same from a child
    process as from a thread."""
    remote, local, _ = servers
    bodies = [("/v1/completions", {"prompt": ALICE, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2,
                                   "logit_bias": {"50": 5}}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Who is Alice?"}], "max_tokens": 8,
                                        "temperature": 0, "thinking_token_budget": 2, "logit_bias": {"50": 5}})]
    for path, body in bodies:
        want, got = _post(local, path, body).json(), _post(remote, path, body).json()
        assert "error" not in got and got["choices"] == want["choices"]
    echoed = _post(remote, *bodies[0]).json()["choices"][0]["logprobs"]
    assert echoed["token_logprobs"][0] is None and len(echoed["tokens"]) > 4
    assert all(v is not None for v in echoed["token_logprobs"][1:])


def test_refusals_and_a_client_that_leaves(servers):
    remote, _, process = servers
    too_long = _post(remote, "/v1/completions", {"prompt": [1] * 5000, "max_tokens": 4})
    assert too_long.status_code == 400
    with httpx.stream("POST", remote.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": ALICE, "max_tokens": 60, "stream": True,
                            "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break                                   # leave after the first chunk
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = process.stats()
        if process.load() == 0 and stats.get("running") == 0 and stats.get("free_blocks") == stats.get("num_blocks"):
            break
        time.sleep(0.1)
    assert process.load() == 0 and stats["running"] == 0 and stats["free_blocks"] == stats["num_blocks"]
    metrics = httpx.get(remote.url + "/metrics", timeout=10).text
    assert 'orinfer_request_success_total{finish_reason="abort"}' in metrics
    assert _post(remote, "/v1/completions", {"prompt": ALICE, "max_tokens": 4}).status_code == 200


def test_a_dead_engine_answers_503(tiny_dir):
    process = EngineProcess(functools.partial(LLM, tiny_dir, SETTINGS), LLM.load_tokenizer(tiny_dir, SETTINGS))
    with BackgroundServer(build_app(process, "tiny")) as server:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        process._process.kill()
        deadline = time.monotonic() + 30
        while process.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        assert _post(server, "/v1/completions", {"prompt": ALICE, "max_tokens": 4}).status_code == 503


def test_errors_that_do_not_pickle_still_reach_the_server():
    from orinfer.errors import RequestError
    from orinfer.server.engine_process import _picklable

    class Local(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a} {b}")

    kept = RequestError("the prompt is empty")
    assert _picklable(kept) is kept
    converted = _picklable(Local(1, 2))
    assert isinstance(converted, RuntimeError) and "Local: 1 2" in str(converted)


def test_an_engine_that_cannot_start_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="did not start"):
        EngineProcess(functools.partial(LLM, tmp_path / "missing", SETTINGS), None, start_timeout=120)


def test_latency_metrics_count_from_the_servers_hand_off(servers, monkeypatch):
    """The engine's TTFT, queue and end-to-end histograms count from the moment the server handed the request over
    (`RequestGroup.arrival`, on the host's monotonic clock), not from when the engine thread picked it up: the
    wait for a step in progress and the engine process's pipe are in them. Here the hand-off is made to look 100 s
    older, and both engines' histograms show it."""
    import types

    from orinfer.server import request_group

    early = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() - 100.0)
    monkeypatch.setattr(request_group, "time", early)

    def total(server, name: str) -> float:
        page = httpx.get(server.url + "/metrics", timeout=30).text
        return float(next(line.split()[1] for line in page.splitlines() if line.startswith(f"orinfer_{name}_sum ")))

    for server in servers[:2]:
        before = {n: total(server, n) for n in ("time_to_first_token_seconds", "e2e_request_latency_seconds")}
        assert "error" not in _post(server, "/v1/completions", {"prompt": ALICE, "max_tokens": 2}).json()
        for name, value in before.items():
            assert 100.0 <= total(server, name) - value < 160.0, name
