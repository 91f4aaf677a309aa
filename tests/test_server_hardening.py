"""Server hardening against the real server (127.0.0.1, API key on): admission of `n` against --max-pending (400 for
a request that can never be admitted, 429 with Retry-After for a busy server), sampling values that break in the
sampler's float32, HEAD /health and no slash redirect built from the Host header, completions' `logprobs: 0`, and
the Content-Type (JSON, UTF-8) a POST must declare."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from orinfer import LLM, SamplingParams  # noqa: E402
from orinfer.engine.sequence import TokenLogprob  # noqa: E402
from orinfer.errors import RequestError  # noqa: E402
from orinfer.server.app import ServerLimits, build_app  # noqa: E402
from orinfer.server.cli import BackgroundServer  # noqa: E402
from orinfer.server.logprobs import LogprobFormatter  # noqa: E402

KEY = "sk-test-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MAX_PENDING = 2


@pytest.fixture(scope="module")
def app(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_model_len=512)
    return build_app(llm, "tiny", api_key=KEY, limits=ServerLimits(max_tokens=64, max_pending_sequences=MAX_PENDING))


@pytest.fixture(scope="module")
def server(app):
    with BackgroundServer(app) as bg:
        yield bg


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as c:
        yield c


def chat(**fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": "Who is Alice?"}], "max_tokens": 4, **fields}


def comp(**fields):
    return {"model": "tiny", "prompt": "Alice was beginning to get very", "max_tokens": 4, **fields}


def _error(r, status, param=None):
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


# --- 1, 3: admission --------------------------------------------------------------------------------------------------

def test_n_above_max_pending_is_400_on_an_idle_server(http):
    err = _error(http.post(COMP, json=comp(n=MAX_PENDING + 1)), 400, "n")
    assert f"n={MAX_PENDING + 1}" in err["message"] and f"limit of {MAX_PENDING}" in err["message"]
    _error(http.post(CHAT, json=chat(n=MAX_PENDING + 1)), 400, "n")
    # prompts x n counts: two prompts with n=2 are four sequences
    _error(http.post(COMP, json=comp(prompt=["Alice", "Down"], n=2)), 400, "n")
    assert http.post(COMP, json=comp(n=MAX_PENDING)).status_code == 200


def test_busy_server_is_429_with_retry_after(app, http, monkeypatch):
    monkeypatch.setattr(app.state.server.loop, "load", lambda: MAX_PENDING)  # the engine holds all it may
    r = http.post(COMP, json=comp())
    err = _error(r, 429)
    assert err["type"] == "rate_limit_error"
    assert r.headers["retry-after"] == "1"
    monkeypatch.undo()
    assert http.post(COMP, json=comp()).status_code == 200


# --- 2: values the sampler's float32 cannot hold ----------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 1e-300),   # 0 in float32: logits / 0
    ("repetition_penalty", 1e-39),    # a float32 subnormal whose reciprocal overflows
    ("repetition_penalty", 1e39),     # inf in float32
    ("temperature", 1e39),
    ("top_p", 1e-300),                # 0 in float32, but top_p must be > 0
    ("top_k", 2 ** 63),               # beyond int64
])
def test_sampling_params_refuse_values_float32_cannot_hold(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(RequestError, match=field):  # also a checkpoint's generation_config
        SamplingParams().with_defaults({field: value})


def test_sampling_params_keep_small_values_float32_can_hold():
    SamplingParams(repetition_penalty=1e-30, top_p=1e-30, temperature=1e-300, min_p=1e-300, top_k=2 ** 63 - 1)


@pytest.mark.parametrize("path,body,param", [
    (CHAT, chat(repetition_penalty=1e-300), "repetition_penalty"),
    (COMP, comp(repetition_penalty=1e-300), "repetition_penalty"),
    (COMP, comp(top_p=1e-300), "top_p"),
])
def test_server_refuses_values_float32_cannot_hold(http, path, body, param):
    _error(http.post(path, json=body), 400, param)


# --- 4: /health -------------------------------------------------------------------------------------------------------

def test_head_health(server):
    r = httpx.head(server.url + "/health", timeout=10)  # no API key needed, as for GET
    assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize("path", ["/health/", "/v1/models/", "/metrics/"])
def test_no_redirect_built_from_the_host_header(http, path):
    r = http.get(path, headers={"Host": "evil.example"}, follow_redirects=False)
    assert "location" not in r.headers and not 300 <= r.status_code < 400
    _error(r, 404)


# --- 5: completions logprobs 0 ----------------------------------------------------------------------------------------

class _Tok:
    def id_to_token(self, i):
        return "abcd"[i]


def test_completion_top_logprobs_hold_the_sampled_token():
    fmt = LogprobFormatter(_Tok())
    out = fmt.completion([TokenLogprob(1, -0.5),                                  # logprobs 0
                          TokenLogprob(2, -3.0, [(1, -0.1), (3, -1.0)]),          # sampled outside the top 2
                          TokenLogprob(1, -0.1, [(1, -0.1), (3, -1.0)])], 0)      # sampled is the top 1
    assert out.tokens == ["b", "c", "b"] and out.token_logprobs == [-0.5, -3.0, -0.1]
    assert out.top_logprobs == [{"b": -0.5}, {"c": -3.0, "b": -0.1, "d": -1.0}, {"b": -0.1, "d": -1.0}]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_zero(http, stream):
    r = http.post(COMP, json=comp(logprobs=0, temperature=0, max_tokens=5, stream=stream))
    assert r.status_code == 200, r.text[:300]
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    else:
        lps = [r.json()["choices"][0]["logprobs"]]
    tokens = [t for lp in lps for t in lp["tokens"]]
    token_logprobs = [v for lp in lps for v in lp["token_logprobs"]]
    tops = [t for lp in lps for t in lp["top_logprobs"]]
    assert len(tokens) == len(token_logprobs) == len(tops) == 5
    assert tops == [{t: v} for t, v in zip(tokens, token_logprobs)]
    assert all(v <= 0 for v in token_logprobs)


def test_completion_logprobs_include_the_sampled_token(http):
    out = http.post(COMP, json=comp(logprobs=1, temperature=1.5, seed=3, max_tokens=8)).json()
    lp = out["choices"][0]["logprobs"]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(value)


# --- 6: Content-Type --------------------------------------------------------------------------------------------------

def test_post_without_content_type_is_415(http):
    r = http.post(COMP, content=json.dumps(comp()).encode())
    assert "content-type" not in r.request.headers
    _error(r, 415)


@pytest.mark.parametrize("charset", ["utf-16", "UTF-16LE", "latin-1", '"utf-32"'])
def test_non_utf8_charset_is_415(http, charset):
    name = charset.strip('"')
    body = json.dumps(comp()).encode(name)
    err = _error(http.post(COMP, content=body, headers={"Content-Type": f"application/json; charset={charset}"}), 415)
    assert name.lower() in err["message"].lower()


@pytest.mark.parametrize("ctype", ["application/json; charset=utf-8", "application/json;charset=UTF-8",
                                   'application/json; charset="utf-8"', "application/json; charset=utf8"])
def test_utf8_charset_is_accepted(http, ctype):
    r = http.post(COMP, content=json.dumps(comp()).encode(), headers={"Content-Type": ctype})
    assert r.status_code == 200, r.text[:300]


def test_utf16_body_without_charset_is_400(http):
    r = http.post(COMP, content=json.dumps(comp()).encode("utf-16"), headers={"Content-Type": "application/json"})
    _error(r, 400)


# --- 9: Host header (DNS rebinding) -----------------------------------------------------------------------------------

def test_loopback_server_without_a_key_answers_only_to_loopback_host_names(tiny_dir):
    """A page on evil.example whose DNS name was rebound to 127.0.0.1 reaches a loopback server with Host:
    evil.example: refused (403) before any route, /health included; loopback names with any port are served."""
    from orinfer.server.cli import LOOPBACK_HOSTS

    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_model_len=512)
    app = build_app(llm, "tiny", limits=ServerLimits(max_tokens=8, allowed_hosts=LOOPBACK_HOSTS))
    with BackgroundServer(app) as bg, httpx.Client(base_url=bg.url, timeout=30) as c:
        port = bg.url.rsplit(":", 1)[1]
        for host in (f"evil.example:{port}", "evil.example", "127.0.0.1.evil.example", f"[::2]:{port}"):
            for path in ("/health", "/v1/models"):
                err = _error(c.get(path, headers={"Host": host}), 403)
                assert err["code"] == "host_not_allowed"
            _error(c.post(COMP, json=comp(), headers={"Host": host}), 403)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "127.0.0.1"):
            assert c.get("/health", headers={"Host": host}).status_code == 200, host
        assert c.post(COMP, json=comp(), headers={"Host": f"localhost:{port}"}).status_code == 200


@pytest.mark.parametrize("host, key, expected", [
    ("127.0.0.1", None, {"localhost", "127.0.0.1", "::1"}),
    ("127.0.0.5", None, {"localhost", "127.0.0.1", "::1", "127.0.0.5"}),
    ("localhost", None, {"localhost", "127.0.0.1", "::1"}),
    ("127.0.0.1", "secret", None),          # a key protects it: any Host (reverse proxies, tunnels)
    ("0.0.0.0", None, None),                # reachable by name from elsewhere: the operator names it
])
def test_orinfer_serve_checks_the_host_when_loopback_has_no_key(host, key, expected):
    import argparse

    from orinfer.server.cli import add_serve_parser, serve_limits

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "-m", "x", "--host", host] + (["--api-key", key] if key else []))
    limits = serve_limits(args)
    assert (None if limits.allowed_hosts is None else set(limits.allowed_hosts)) == expected


# --- 6: a client that leaves in the middle of its body ----------------------------------------------------------------

def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_client_leaving_mid_body_is_a_499_not_a_500(server, caplog):
    import socket
    import time

    host, port = server.url.split("//")[1].rsplit(":", 1)
    route = '{code="%s",route="/v1/chat/completions"}'
    before_500 = _metric(server, "orinfer_http_requests_total" + route % "500")
    before_499 = _metric(server, "orinfer_http_requests_total" + route % "499")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\":".encode())
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while _metric(server, "orinfer_http_requests_total" + route % "499") == before_499 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "orinfer_http_requests_total" + route % "499") == before_499 + 1
    assert _metric(server, "orinfer_http_requests_total" + route % "500") == before_500
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


# --- 2: a huge prompt is refused by its characters, before tokenizing -------------------------------------------------

def test_a_prompt_is_refused_by_its_characters_before_it_is_tokenized(app, http, monkeypatch):
    """The context is 512 tokens: more than 16 x 512 characters cannot fit, and are refused without tokenizing or
    rendering (the tokenizer is not called); just under that, the prompt is tokenized and refused by its tokens."""
    srv = app.state.server
    calls = []
    monkeypatch.setattr(srv.tokenizer, "encode", lambda text, *a, **k: calls.append(len(text)) or [1] * len(text))
    too_long = "ab " * 2731                                     # 8193 characters
    err = _error(http.post(COMP, json=comp(prompt=too_long)), 400, "prompt")
    assert "8193 characters" in err["message"] and err["code"] == "context_length_exceeded"
    messages = [{"role": "user", "content": [{"type": "text", "text": too_long}]}]
    err = _error(http.post(CHAT, json=chat(messages=messages)), 400, "messages")
    assert "characters" in err["message"]
    assert calls == []
    err = _error(http.post(COMP, json=comp(prompt="ab " * 2730)), 400)   # 8190 characters: tokenized, then too long
    assert calls == [8190] and "characters" not in err["message"]


# --- 3: a large response is built off the event loop ------------------------------------------------------------------

def test_non_streaming_bodies_are_built_in_a_worker_thread(app, http, monkeypatch):
    """n x max_tokens x top logprobs can make a body of tens of MB: its building (logprob formatting) and encoding
    run in a worker thread, so the event loop keeps answering (/health) meanwhile. Same bytes as before."""
    import threading

    srv = app.state.server
    threads = []
    real_completion, real_chat = srv.completion_logprobs, srv.chat_logprobs
    monkeypatch.setattr(srv, "completion_logprobs",
                        lambda *a: threads.append(threading.current_thread().name) or real_completion(*a))
    monkeypatch.setattr(srv, "chat_logprobs",
                        lambda *a: threads.append(threading.current_thread().name) or real_chat(*a))
    r = http.post(COMP, json=comp(n=2, logprobs=3, max_tokens=6, temperature=0))
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert len(body["choices"]) == 2 and len(body["choices"][0]["logprobs"]["tokens"]) == 6
    assert http.post(CHAT, json=chat(logprobs=True, top_logprobs=2, max_tokens=5)).status_code == 200
    assert len(threads) == 3 and all(name.startswith("asyncio") for name in threads), threads


# --- 4: slow clients and the connection cap ---------------------------------------------------------------------------

def test_slow_clients_are_cut_off_and_connections_capped(tiny_dir):
    """A connection that sends nothing, half a head or half a body is closed once the read deadline passes; a request
    that arrives whole in time is served; connections beyond the cap get 503 at once instead of a reset later."""
    import socket
    import time

    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_model_len=512)
    limits = ServerLimits(max_tokens=8, request_read_timeout_s=1.0, max_connections=5)
    with BackgroundServer(build_app(llm, "tiny", limits=limits)) as bg:
        host, port = bg.url.split("//")[1].rsplit(":", 1)
        head = f"POST {COMP} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sockets = []
        for payload in (b"", head.encode(), (head + "Content-Length: 500\r\n\r\n{\"prompt\":").encode()):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(payload)
            sockets.append(sock)
        time.sleep(0.2)
        # Three held + this one stay under the cap of five (uvicorn refuses the connection that reaches it).
        with socket.create_connection((host, int(port)), timeout=10) as probe:
            probe.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert probe.recv(100).startswith(b"HTTP/1.1 200")
            with socket.create_connection((host, int(port)), timeout=10) as extra:
                extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert extra.recv(100).startswith(b"HTTP/1.1 503")
        start = time.monotonic()
        for sock in sockets:                  # each is closed by the server: recv returns b"" (or an error reply)
            data = sock.recv(1000)
            assert data == b"" or data.startswith(b"HTTP/1.1 4"), data[:80]
            sock.close()
        assert time.monotonic() - start < 8
        assert httpx.get(bg.url + "/health", timeout=10).status_code == 200
