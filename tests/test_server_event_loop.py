"""Nothing a client sends holds the server's event loop (issue 34), checked by structure rather than by timing: the
start-up heap is out of the collector's full passes (server and engine processes), busy worker threads hand the
interpreter lock back to the event loop sooner, a body is counted before it is parsed (too many values: 413 without
parsing it), bodies beyond a small size are parsed and validated in a worker thread, validation stops at the first
bad item of a list instead of formatting a body's worth of errors, and the handlers' walks over a body's lists run
in worker threads."""

from __future__ import annotations

import functools
import gc
import json
import logging
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from pydantic import ValidationError  # noqa: E402

from orinfer import LLM  # noqa: E402
from orinfer.server import json_count, request_body  # noqa: E402
from orinfer.server.app import ServerLimits, build_app  # noqa: E402
from orinfer.server.cli import BackgroundServer  # noqa: E402
from orinfer.server.errors import APIError  # noqa: E402
from orinfer.server.interpreter import freeze_startup_heap  # noqa: E402
from orinfer.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest  # noqa: E402

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MAX_VALUES = 1000
USER = [{"role": "user", "content": "Who is Alice?"}]


@pytest.fixture(scope="module")
def app(tiny_dir):
    """The tiny model's app with small limits on a body's values (MAX_VALUES) and on logit_bias (8 entries)."""
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_model_len=512)
    return build_app(llm, "tiny", limits=ServerLimits(max_tokens=8, max_body_values=MAX_VALUES, max_logit_bias=8))


@pytest.fixture(scope="module")
def http(app):
    """A client of `app`, served on loopback for the module."""
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


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


def test_orinfer_serve_sets_up_its_interpreter_before_it_serves(tiny_dir, monkeypatch):
    """The heap is frozen and the switch interval shortened once the app is built, before uvicorn takes traffic."""
    import uvicorn

    from orinfer.cli import main
    from orinfer.server import interpreter

    events = []
    monkeypatch.setattr(interpreter, "freeze_startup_heap", lambda: events.append("freeze") or 0)
    monkeypatch.setattr(interpreter, "shorten_switch_interval", lambda: events.append("switch"))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: events.append("serve"))
    assert main(["serve", "-m", str(tiny_dir), "--device", "cpu", "--no-engine-process", "--port", "0"]) == 0
    assert events == ["freeze", "switch", "serve"]


def test_the_switch_interval_is_shortened():
    import sys

    from orinfer.server import interpreter

    before = sys.getswitchinterval()
    try:
        interpreter.shorten_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(interpreter.SWITCH_INTERVAL_S)
        assert interpreter.SWITCH_INTERVAL_S < before
    finally:
        sys.setswitchinterval(before)


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


# --- counting a body's values -----------------------------------------------------------------------------------------

def _values(value) -> int:
    """The count json_count documents: 1 per value, plus 1 per empty array or object."""
    if isinstance(value, list):
        return 1 + (not value) + sum(_values(v) for v in value)
    if isinstance(value, dict):
        return 1 + (not value) + sum(_values(v) for v in value.values())
    return 1


@pytest.mark.parametrize("text", [
    '{"a": "x, y, [z] {w}", "b": [1, 2, 3], "c": "\\\\", "d": "q\\",r[", "e": {}}',
    '["\\\\\\"", ",", "[", 1, [], [[1, 2], {"k": "v,"}]]',
    '"a, b, [c]"', "[]", "7",
])
def test_values_are_counted_outside_strings(text):
    want = _values(json.loads(text))
    for limit in range(want + 3):
        assert (json_count.check(text.encode(), limit, 100) is not None) == (want > limit), limit


def test_deep_nesting_and_wide_bodies_are_told_apart():
    assert json_count.check(b"[" * 2000 + b"]" * 2000, 1000, 900) is json_count.Excess.DEPTH
    assert json_count.check(b"[" + b"[1]," * 1000 + b"1]", 1000, 900) is json_count.Excess.VALUES
    assert json_count.check(b'["' + b"," * 1000 + b'"]', 1000, 900) is None  # 1000 commas, all in a string


def test_a_body_of_too_many_values_is_refused_before_it_is_parsed(monkeypatch):
    parsed = []
    monkeypatch.setattr(request_body, "json", type("J", (), {"loads": staticmethod(
        lambda text, **kw: parsed.append(len(text)) or json.loads(text, **kw))}))
    with pytest.raises(APIError) as exc:
        request_body.parse_json(json.dumps({"prompt": [1] * MAX_VALUES}).encode(), MAX_VALUES)
    assert exc.value.status == 413 and exc.value.code == "request_too_large" and parsed == []
    assert request_body.parse_json(json.dumps({"prompt": [1] * 990}).encode(), MAX_VALUES)["prompt"] == [1] * 990


def test_too_many_values_is_a_413_and_deep_nesting_stays_a_400(http):
    r = http.post(COMP, json={"prompt": [1] * MAX_VALUES, "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert f"more than {MAX_VALUES} JSON values" in r.json()["error"]["message"]
    r = http.post(CHAT, content=b"[" * 5000 + b"]" * 5000, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert http.post(COMP, json={"prompt": [1] * 400, "max_tokens": 1}).status_code == 200


# --- where bodies are parsed and validated ----------------------------------------------------------------------------

def test_large_bodies_are_parsed_and_validated_in_a_worker_thread(http, monkeypatch):
    """A body of up to SMALL_BODY_BYTES and SMALL_BODY_VALUES values is handled on the event loop (the server's
    thread), a long string included (as a long prompt is); one larger in either measure in a worker thread of the default pool, so
    that its parsing and validation never hold the loop."""
    threads = []
    real = request_body.validate_body
    monkeypatch.setattr(request_body, "validate_body",
                        lambda model, body: threads.append(threading.current_thread().name) or real(model, body))
    small = {"messages": USER, "max_tokens": 1}
    long_string = {"messages": USER, "max_tokens": 1, "user": "x" * 40_000}     # a long prompt's shape: 40 KB
    many_bytes = {"messages": USER, "max_tokens": 1, "user": "x" * request_body.SMALL_BODY_BYTES}
    monkeypatch.setattr(request_body, "SMALL_BODY_VALUES", 16)     # within this test server's value limit
    many_values = {"messages": USER, "max_tokens": 1, "stop_token_ids": [1] * 17}
    for body in (small, long_string, many_bytes, many_values):
        assert http.post(CHAT, json=body).status_code == 200
    assert len(threads) == 4
    on_loop = [not name.startswith("asyncio") for name in threads]
    assert on_loop == [True, True, False, False], threads


# --- validation stops at the first bad item ---------------------------------------------------------------------------

@pytest.mark.parametrize("model,body,most", [
    (CompletionRequest, {"prompt": [-1] * 5000}, 4),               # one error per member of the prompt's union
    (CompletionRequest, {"prompt": [[1, -1]] * 5000}, 4),
    (DetokenizeRequest, {"tokens": ["x"] * 5000}, 1),
    (ChatCompletionRequest, {"messages": [{"role": "wizard"}] * 5000}, 1),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "x"}] * 5000}]}, 2),
    (ChatCompletionRequest, {"messages": USER, "stop_token_ids": [-1] * 5000}, 1),
    (ChatCompletionRequest, {"messages": USER, "logit_bias": {str(i): "x" for i in range(5000)}}, 1),
])
def test_validation_reports_the_first_bad_item_only(model, body, most):
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body)
    assert exc.value.error_count() <= most


def test_integral_floats_in_token_id_lists_are_still_ints():
    assert CompletionRequest.model_validate({"prompt": [1.0, 2]}).prompt == [1, 2]
    assert CompletionRequest.model_validate({"prompt": [[3, 4.0]]}).prompt == [[3, 4]]
    assert CompletionRequest.model_validate({"prompt": [5, 6]}).prompt == [5, 6]
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": [1.5]})


# --- the handlers' work that grows with the body ----------------------------------------------------------------------

def test_chat_checks_and_costly_sampling_params_are_built_in_worker_threads(app, http, monkeypatch):
    """Walking the messages, parts and tools of a chat (`chat_input`, tools) and building sampling parameters that
    cost work (logit_bias, tool grammars, a response format's grammar) happen in worker threads: each grows with the
    body (tens of thousands of parts or entries fit in the value limit), and on the loop a body of 20,000 text parts
    stalled it for 150 ms. Plain sampling parameters of a few choices are built on the loop: a thread hop cost more
    than they do under a burst of requests."""
    from orinfer.server import chat as chat_module

    srv = app.state.server
    threads = {}
    real_input, real_sampling = chat_module.chat_input, srv.sampling
    monkeypatch.setattr(chat_module, "chat_input", lambda *a: threads.setdefault(
        "chat_input", threading.current_thread().name) and real_input(*a))
    monkeypatch.setattr(srv, "sampling", lambda *a, **k: threads.setdefault(
        "sampling", threading.current_thread().name) and real_sampling(*a, **k))

    def sampled_in_a_thread(path: str, body: dict) -> bool:
        threads.clear()
        assert http.post(path, json=body).status_code == 200
        return threads["sampling"].startswith("asyncio")

    parts = [{"type": "text", "text": "Who is Alice?"}] * 3
    assert not sampled_in_a_thread(CHAT, {"messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert threads["chat_input"].startswith("asyncio"), threads
    assert not sampled_in_a_thread(COMP, {"prompt": "Alice", "max_tokens": 1, "n": 2})
    assert sampled_in_a_thread(COMP, {"prompt": "Alice", "max_tokens": 1, "logit_bias": {"5": 1}})
    assert sampled_in_a_thread(CHAT, {"messages": USER, "max_tokens": 1, "logit_bias": {"5": 1}})
    assert sampled_in_a_thread(CHAT, {"messages": USER, "max_tokens": 1,
                                      "response_format": {"type": "json_object"}})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert sampled_in_a_thread(CHAT, {"messages": USER, "max_tokens": 1, "tools": [tool]})


def test_logit_bias_has_a_limit(http):
    r = http.post(CHAT, json={"messages": USER, "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(9)}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias" and "at most 8" in r.text
    assert http.post(CHAT, json={"messages": USER, "max_tokens": 1, "logit_bias": {"5": 1}}).status_code == 200


# --- slow-step log (ORINFER_SLOW_STEP_MS) --------------------------------------------------------------------------------


def test_slow_steps_are_logged_with_their_batch_when_asked(http, monkeypatch, caplog):
    from orinfer.server import engine_loop

    body = {"model": "tiny", "prompt": "Alice was", "max_tokens": 3, "temperature": 0}
    with caplog.at_level(logging.WARNING, logger="orinfer.server.engine_loop"):
        assert http.post(COMP, json=body).status_code == 200
        assert not [r for r in caplog.records if "slow step" in r.message]  # off by default: no timing at all
        monkeypatch.setattr(engine_loop, "SLOW_STEP_MS", 1e-6)  # every step is "slow"
        assert http.post(COMP, json=body).status_code == 200
    slow = [r.getMessage() for r in caplog.records if "slow step" in r.getMessage()]
    assert slow and all("running and" in m and "advanced" in m for m in slow)
    assert any("1 running and 0 waiting" in m or "0 running and 1 waiting" in m for m in slow)
