"""Structured outputs through the OpenAI-compatible server on the tiny model: response_format (json_object and
json_schema), vLLM's structured_outputs object and guided_* fields on both endpoints, n > 1, streaming, thinking,
and the 400s (an uncompilable schema with the library's reason, two kinds at once)."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from orinfer import LLM  # noqa: E402
from orinfer.server.app import build_app  # noqa: E402
from orinfer.server.cli import BackgroundServer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
USER = [{"role": "user", "content": "Who is Alice?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_model_len=512)
    with BackgroundServer(build_app(llm, "tiny")) as bg:
        yield bg


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_response_format_json_schema_with_n(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model="tiny", messages=USER, n=3, temperature=1.0, seed=5, max_tokens=40,
                                         response_format=fmt, extra_body=NO_THINK)
    validator = jsonschema_rs.validator_for(SCHEMA)
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert validator.is_valid(json.loads(choice.message.content)), choice.message.content


def test_response_format_json_object_streamed_equals_plain(client):
    common = dict(model="tiny", messages=USER, temperature=1.0, seed=11, max_tokens=30,
                  response_format={"type": "json_object"}, extra_body=NO_THINK)
    plain = client.chat.completions.create(**common).choices[0]
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **common)
                   if c.choices)
    assert text == plain.message.content and text.startswith("{")
    if plain.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_completions_guided_fields_and_structured_outputs(client):
    regex = client.completions.create(model="tiny", prompt="Alice was", max_tokens=12, temperature=1.0, seed=1, n=2,
                                      extra_body={"guided_regex": "[a-z]{2,5} [0-9]{2}"})
    assert all(re.fullmatch("[a-z]{2,5} [0-9]{2}", c.text) for c in regex.choices)
    choice = client.completions.create(model="tiny", prompt="Alice was", max_tokens=12, temperature=1.0, seed=2,
                                       extra_body={"structured_outputs": {"choice": ["a cat", "a rabbit"]}})
    assert choice.choices[0].text in ("a cat", "a rabbit")
    guided = client.completions.create(model="tiny", prompt="Alice was", max_tokens=40, temperature=1.0, seed=3,
                                       extra_body={"guided_json": SCHEMA})
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(guided.choices[0].text))
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=1.0, seed=4,
                                          extra_body={"guided_choice": ["yes", "no"], **NO_THINK})
    assert chat.choices[0].message.content in ("yes", "no")


def test_thinking_prompt_leaves_reasoning_free(client):
    """With thinking on (the template leaves the output to open <think>), the constraint still allows <think>, and
    an answer that does not think is constrained from its first token."""
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0.0,
                                         extra_body={"guided_choice": ["yes", "no"]})
    msg = out.choices[0].message
    if msg.reasoning_content is None:
        assert msg.content in ("yes", "no")


@pytest.mark.parametrize("body, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "nonsense"),
    ({"guided_regex": "a(b"}, "unclosed group"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "only one kind"),
    ({"response_format": {"type": "yaml"}}, "not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
])
def test_bad_constraints_are_400s(server, body, reason):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": USER, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "Alice", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text


def test_engine_in_a_child_process(tiny_dir, server):
    """`orinfer serve` runs the engine in a child process: the constraint travels there (pickled), is compiled there,
    and gives the answer of the engine in a thread; an uncompilable schema still comes back as a 400."""
    import functools

    from orinfer.args import EngineArgs
    from orinfer.server.engine_process import EngineProcess

    settings = EngineArgs(dtype="float32", device="cpu", progress=False, max_model_len=512)
    process = EngineProcess(functools.partial(LLM, tiny_dir, settings), LLM.load_tokenizer(tiny_dir, settings))
    body = {"model": "tiny", "prompt": "Alice was", "max_tokens": 30, "temperature": 1.0, "seed": 9,
            "guided_json": SCHEMA}
    with BackgroundServer(build_app(process, "tiny")) as remote:
        got = httpx.post(remote.url + "/v1/completions", json=body, timeout=120)
        bad = httpx.post(remote.url + "/v1/completions", timeout=60,
                         json={**body, "guided_json": {"type": "nonsense"}})
    want = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(got.json()["choices"][0]["text"]))
    assert bad.status_code == 400 and "nonsense" in bad.json()["error"]["message"]
