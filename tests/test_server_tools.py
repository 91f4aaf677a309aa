"""Tool calling end to end: the real server (official openai client) and `LLM.chat` over a tiny Qwen3 trained to
answer with fixed tool calls (tests/tool_model.py), once under the Qwen3 template (JSON calls) and once under the
Qwen3.5 template (XML calls): the engine generates every token. Calls with and without reasoning first and inside the
reasoning, streamed fragments against the whole answer, every tool_choice value and its 400s, tool results in a
follow-up turn."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from orinfer import LLM, SamplingParams  # noqa: E402
from orinfer.errors import RequestError  # noqa: E402
from orinfer.server.app import build_app  # noqa: E402
from orinfer.server.chat import chat_stream  # noqa: E402
from orinfer.server.cli import BackgroundServer  # noqa: E402
from orinfer.server.engine_loop import SeqUpdate  # noqa: E402
from orinfer.reasoning import ThinkState  # noqa: E402
from orinfer.server.tools import ChatTools  # noqa: E402
from orinfer.tool_calls import ToolChoice  # noqa: E402
from tool_model import ANSWER_TO_RESULT, CALL_ARGS, JSON_CALL, TOOLS, result_turn  # noqa: E402

NAMED = {"type": "function", "function": {"name": "get_weather"}}


class _Group:
    def __init__(self, updates):
        self._updates = updates

    async def updates(self):
        for u in self._updates:
            yield u

    def abort(self):
        pass


class _Server:
    name = "fake"


def _stream_chunks(pieces: list[str], finish: str, max_calls: int | None) -> list[dict]:
    updates = [SeqUpdate(0, p, [], i + 1, None) for i, p in enumerate(pieces)] + [SeqUpdate(0, "", [], 99, finish)]
    tools = ChatTools(TOOLS, ToolChoice("auto"), True, max_calls)

    async def run():
        return [e async for e in chat_stream(_Server(), _Group(updates), "id", 0, 1, 5, ThinkState.START, False,
                                             False, tools)]

    events = asyncio.run(asyncio.wait_for(run(), 10))
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


@pytest.mark.parametrize("finish, max_calls", [("stop", None), ("stop", 1), ("length", None)])
def test_stream_chunks_of_calls(finish, max_calls):
    """The SSE chunks of an answer with two calls (no model): OpenAI's delta shapes, `parallel_tool_calls: false`
    keeping the first call only, finish_reason "tool_calls" only when generation stopped by itself."""
    text = ('Checking.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
            '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    chunks = _stream_chunks([text[i:i + 3] for i in range(0, len(text), 3)], finish, max_calls)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    heads = [tc for tc in calls if "id" in tc]
    assert [(h["index"], h["type"], h["function"]["name"], h["function"]["arguments"]) for h in heads] == \
        [(0, "function", "get_weather", ""), (1, "function", "get_weather", "")][:max_calls or 2]
    fragments: dict[int, list[str]] = {}
    for tc in calls:
        if "id" not in tc:
            fragments.setdefault(tc["index"], []).append(tc["function"]["arguments"])
    # The JSON arguments stream in pieces (3-character pieces here) that join up to the whole arguments.
    assert {i: "".join(f) for i, f in fragments.items()} == \
        dict(enumerate(['{"city": "Paris", "days": 3}', '{"city": "Rome"}'][:max_calls or 2]))
    assert len(fragments[0]) >= 5
    assert all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
               for tc in calls if "id" not in tc)
    assert chunks[-1]["choices"][0]["finish_reason"] == ("tool_calls" if finish == "stop" else "length")


@pytest.fixture(scope="module")
def clients(tool_dirs):
    """An openai client per template kind ("json", "xml"), each talking to its own server."""
    with BackgroundServer(build_app(LLM(tool_dirs["json"], dtype="float32", device="cpu", progress=False),
                                    "tiny-json")) as js, \
            BackgroundServer(build_app(LLM(tool_dirs["xml"], dtype="float32", device="cpu", progress=False),
                                       "tiny-xml")) as xs:
        made = {kind: openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
                for kind, s in (("json", js), ("xml", xs))}
        yield made
        for c in made.values():
            c.close()


def _ask(client, user: str | list, stream: bool = False, **kw):
    messages = [{"role": "user", "content": user}] if isinstance(user, str) else user
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          max_tokens=80, temperature=0, stream=stream, **kw)


def _streamed(client, user, **kw):
    """(reasoning, content, {index: [deltas]}, finish_reason, content pieces) of a streamed answer."""
    reasoning = content = ""
    calls: dict[int, list] = {}
    pieces, finish = [], None
    for chunk in _ask(client, user, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        if delta.content:
            pieces.append(delta.content)
            content += delta.content
        for tc in delta.tool_calls or []:
            calls.setdefault(tc.index, []).append(tc)
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish, pieces


CASES = [  # kind, user message, extra request fields, expected reasoning
    ("json", "weather please", {}, None),
    ("json", "ponder the weather", {}, "The user wants the weather."),
    ("xml", "weather please", {}, "I need the weather tool."),
    ("xml", "weather please", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, None),
    ("xml", "call inside", {}, "Let me check."),   # the call is written inside the reasoning, which never closes
]


@pytest.mark.parametrize("kind, user, extra, reasoning", CASES)
def test_tool_call_answers_and_streams(clients, kind, user, extra, reasoning):
    client = clients[kind]
    out = _ask(client, user, tools=TOOLS, **extra)
    choice = out.choices[0]
    msg = choice.message
    assert choice.finish_reason == "tool_calls"
    assert msg.content is None and getattr(msg, "reasoning_content", None) == reasoning
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGS

    s_reasoning, s_content, s_calls, finish, pieces = _streamed(client, user, tools=TOOLS, **extra)
    assert (s_reasoning or None, s_content, finish) == (reasoning, "", "tool_calls")
    assert list(s_calls) == [0]
    first, *rest = s_calls[0]
    assert first.id.startswith("call_") and first.type == "function" and first.function.name == "get_weather"
    assert all(d.function.name is None and d.id is None for d in rest)
    assert "".join(d.function.arguments or "" for d in s_calls[0]) == call.function.arguments
    if kind == "xml":   # one fragment per parameter, then the closing brace
        assert len(rest) == len(CALL_ARGS) + 1
    else:               # the JSON arguments stream as the model writes them
        assert len(rest) >= 2


def test_plain_answer_with_tools_is_content(clients):
    out = _ask(clients["json"], "hello", tools=TOOLS)
    assert out.choices[0].message.content == "Hello! How can I help?"
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"
    _, content, calls, finish, _ = _streamed(clients["json"], "hello", tools=TOOLS)
    assert (content, calls, finish) == ("Hello! How can I help?", {}, "stop")


@pytest.mark.parametrize("kind", ["json", "xml"])
def test_tool_choice_none_leaves_tools_out(clients, tool_dirs, kind):
    """"none": the tools are not in the prompt (fewer prompt tokens) and the answer is not parsed."""
    with_tools = _ask(clients[kind], "weather please", tools=TOOLS)
    out = _ask(clients[kind], "weather please", tools=TOOLS, tool_choice="none")
    plain = _ask(clients[kind], "weather please")
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens
    msg = out.choices[0].message
    assert not msg.tool_calls and out.choices[0].finish_reason == "stop"
    if kind == "json":
        assert msg.content == JSON_CALL   # what the model wrote, as text
    else:
        assert "<tool_call>" in msg.content


@pytest.mark.parametrize("choice", ["auto", "required", NAMED])
def test_tool_choice_values_parse_calls(clients, choice):
    for kind in ("json", "xml"):
        out = _ask(clients[kind], "weather please", tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        calls = out.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", CALL_ARGS)]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_tool_choice_required_and_named_are_enforced(clients, choice):
    """"hello" makes the model answer in text; "required" and a named function constrain the answer to a call of the
    tool, in the template's format, whose arguments follow its schema; one call with parallel_tool_calls false."""
    plain = _ask(clients["json"], "hello", tools=TOOLS)
    assert not plain.choices[0].message.tool_calls
    for parallel in (True, False):
        out = _ask(clients["json"], "hello", tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
        calls = out.choices[0].message.tool_calls
        assert calls and all(c.function.name == "get_weather" for c in calls)
        assert len(calls) == 1 or parallel
        for call in calls:
            args = json.loads(call.function.arguments)
            assert isinstance(args["city"], str) and set(args) <= {"city", "days"}
            assert isinstance(args.get("days", 0), int)
        _, content, s_calls, finish, _ = _streamed(clients["json"], "hello", tools=TOOLS, tool_choice=choice,
                                                   parallel_tool_calls=parallel)
        assert s_calls and all(d[0].function.name == "get_weather" for d in s_calls.values())
        # Greedy: the same constrained call streamed; its fragments join up to the non-streamed arguments.
        assert ["".join(d.function.arguments or "" for d in s_calls[i]) for i in sorted(s_calls)] == \
            [c.function.arguments for c in calls]


def test_tool_choice_required_with_a_response_format_is_400(clients):
    with pytest.raises(openai.BadRequestError) as err:
        _ask(clients["json"], "hello", tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert err.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": [{"type": "code"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_tool_fields_are_400s(clients, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        _ask(clients["json"], "weather please", extra_body=fields)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param


def test_tool_choice_none_without_tools_is_fine(clients):
    out = _ask(clients["json"], "hello", tool_choice="none")
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kind, reasoning", [("json", None), ("xml", "The tool answered.")])
def test_tool_result_follow_up(clients, tool_dirs, kind, reasoning):
    """The result of a call goes back as a `tool` message after the assistant's call (arguments as the JSON string
    clients send): the prompt is the one the template renders from that conversation (the model was trained on it,
    with the arguments as an object) and the model answers it."""
    messages = result_turn(kind)
    out = _ask(clients[kind], messages, tools=TOOLS)
    msg = out.choices[0].message
    assert msg.content == ANSWER_TO_RESULT and not msg.tool_calls
    assert getattr(msg, "reasoning_content", None) == reasoning
    tok = LLM.load_tokenizer(tool_dirs[kind])
    expected = [dict(m) for m in messages]
    expected[1] = {**expected[1], "tool_calls": [{**expected[1]["tool_calls"][0],
                                                  "function": {"name": "get_weather", "arguments": CALL_ARGS}}]}
    prompt = tok.apply_chat_template(expected, tools=TOOLS)
    assert "<tool_response>\n" + messages[2]["content"] + "\n</tool_response>" in prompt
    assert out.usage.prompt_tokens == len(tok.encode(prompt))


# --- the Python API --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llms(tool_dirs):
    return {kind: LLM(d, dtype="float32", device="cpu", progress=False) for kind, d in tool_dirs.items()}


def test_llm_chat_splits_calls(llms):
    params = SamplingParams(max_tokens=80, temperature=0)
    out = llms["json"].chat([{"role": "user", "content": "ponder the weather"}], params, tools=TOOLS)[0]
    assert out.reasoning_content == "The user wants the weather." and out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", CALL_ARGS)]
    assert out.tool_calls[0].id.startswith("call_")
    out = llms["xml"].chat([{"role": "user", "content": "call inside"}], params, tools=TOOLS, tool_choice=NAMED)[0]
    assert out.reasoning_content == "Let me check." and out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", CALL_ARGS)]
    out = llms["xml"].chat(result_turn("xml"), params, tools=TOOLS)[0]   # arguments as a JSON string
    assert out.content == ANSWER_TO_RESULT and out.tool_calls == []


def test_llm_chat_tool_choice(llms):
    params = SamplingParams(max_tokens=80, temperature=0)
    out = llms["json"].chat([{"role": "user", "content": "weather please"}], params, tools=TOOLS,
                            tool_choice="none")[0]
    assert out.content == JSON_CALL and out.tool_calls == []
    for bad, tools in [("sometimes", TOOLS), ("required", None),
                       ({"type": "function", "function": {"name": "nope"}}, TOOLS)]:
        with pytest.raises(RequestError, match="tool_choice"):
            llms["json"].chat([{"role": "user", "content": "hi"}], params, tools=tools, tool_choice=bad)
    with pytest.raises(RequestError, match="tools.0.type"):
        llms["json"].chat([{"role": "user", "content": "hi"}], params, tools=[{"type": "x"}])


def test_tool_call_parser_setting(tool_dirs, llms):
    """The format comes from the chat template; EngineArgs.tool_call_parser (--tool-call-parser) overrides it."""
    assert build_app(llms["json"], "j").state.server.tool_format == "qwen-json"
    assert build_app(llms["xml"], "x").state.server.tool_format == "qwen-xml"
    assert build_app(llms["xml"], "x", tool_call_parser="qwen-json").state.server.tool_format == "qwen-json"
    assert build_app(llms["xml"], "x", tool_call_parser="none").state.server.tool_format is None
    off = LLM(tool_dirs["json"], dtype="float32", device="cpu", progress=False, tool_call_parser="none")
    assert build_app(off, "off").state.server.tool_format is None   # the engine's own setting
    params = SamplingParams(max_tokens=80, temperature=0)
    out = off.chat([{"role": "user", "content": "weather please"}], params, tools=TOOLS)[0]
    assert out.content == JSON_CALL and out.tool_calls == []   # tools in the prompt, the answer not parsed
    with pytest.raises(RequestError, match="tool_choice"):
        off.chat([{"role": "user", "content": "weather please"}], params, tools=TOOLS, tool_choice="required")
