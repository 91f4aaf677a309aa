"""orinfer/tool_calls: the Qwen JSON and XML tool-call formats, value types, malformed markup, streaming against
non-streaming parsing over random splits, calls inside the reasoning, tools and tool_choice checks, and the format
judged from the published chat templates (whose rendering of a call must parse back to the same call)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from orinfer.args import EngineArgs
from orinfer.errors import ConfigError
from orinfer.reasoning import ThinkState
from orinfer.tokenizer import Tokenizer, builtin_chat_template
from orinfer.tool_calls import (ChatOutputParser, ToolCallParser, ToolSpecError, check_parser_for, check_tools,
                                detect_format, parse_chat_output, parse_tool_calls, parse_tool_choice, resolve_format)
from orinfer.tool_calls.types import join_deltas
from orinfer.tool_calls.values import convert_value

REAL = Path(__file__).parent / "data" / "real-qwen"   # published chat templates (see its README)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "extra": {"type": "object"}, "hours": {"type": "array"},
        "note": {"type": ["string", "null"]}, "code": {"type": "string"}, "free": {}}}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]

JSON_TWO = ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
XML_ONE = ('I will look it up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n'
           '<parameter=days>\n3\n</parameter>\n<parameter=temp>\n-2.5\n</parameter>\n<parameter=metric>\nTrue\n'
           '</parameter>\n<parameter=extra>\n{"a": [1, 2]}\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n'
           '<parameter=note>\nnull\n</parameter>\n<parameter=code>\n007\n</parameter>\n<parameter=free>\n{"x": 1}\n'
           '</parameter>\n<parameter=unlisted>\n12\n</parameter>\n</function>\n</tool_call>')
XML_TWO = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n\n</parameter>\n</function>\n'
           '</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>\nDone.')
# JSON calls whose arguments stream: nested values, escapes, unicode, exponents; keys in the other order and
# "parameters"; arguments written over several lines.
JSON_LONG = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "S\u00e3o Paulo \\"SP\\"", '
             '"days": 12, "temp": -1.5e-3, "metric": true, "note": null, "extra": {"tags": ["a", "b\\\\c", [], {}], '
             '"emoji": "\\ud83d\\ude00 日本 é", "deep": [[1, [2, [3.25]]], {"k": false}]}, "hours": [0, 6, 12, 18], '
             '"code": "line1\\nline2\\t</tool_ish> <tool_call"}}\n</tool_call>\nDone.')
JSON_REORDERED = ('<tool_call>\n{"parameters": {"city": "Lima", "days": 2}, "id": 7, "name": "get_weather", '
                  '"arguments": {"ignored": 1}}\n</tool_call>\n<tool_call>{"name": "noop", "extra": [1]}</tool_call>')
JSON_PRETTY = '<tool_call>\n{\n  "name": "noop",\n  "arguments": {\n    "a": [\n      1,\n      2\n    ]\n  }\n}\n</tool_call>'
# Bodies that break after the name went out: the call is closed with what was well-formed (its arguments), and the
# whole text, the block's markup included, is the content.
BROKEN_AFTER_NAME = [
    ('cut <tool_call>\n{"name": "noop", "argum', "{}"),                                         # cut off
    ('<tool_call>\n{"name": "noop", "arguments": {"city": "Par\nis"}}\n</tool_call>', '{"city": "Par"}'),
    ('<tool_call>\n{"name": "noop", "arguments": {"a": [1, {"b": tru}]}}\n</tool_call> after', '{"a": [1, {}]}'),
    ('<tool_call>\n{"name": "noop", "arguments": {"n": 12, "m": 3.}}\n</tool_call>', '{"n": 12}'),
    ('<tool_call>\n{"name": "noop", "arguments": {"s": "ab\\qc"}}\n</tool_call>', '{"s": "ab"}'),
    ('<tool_call>\n{"name": "noop", "arguments": {"k": 1}} extra\n</tool_call>', '{"k": 1}'),   # text after it
    ('<tool_call>\n{"name": "noop", "arguments": [1]}\n</tool_call>', "{}"),                    # not an object
    ('<tool_call>\n{"name": "noop", "arguments": "oops"}\n</tool_call>', "{}"),                 # a string, no object
    ('<tool_call>\n{"name": "noop", "arguments": {"c": "a</tool_call> b"}}</tool_call>', '{"c": "a"}'),  # tag inside
    ('<tool_call>\n{"name": "noop", "arguments": {"x": {"y": "z\\u12', '{"x": {"y": "z"}}'),     # cut in an escape
    ('<tool_call>{"name": "noop", "arguments": {"a": NaN}}</tool_call>', "{}"),                   # not strict JSON
    ('<tool_call>\n{"name": "noop", "arguments": {"a": 1}}\n</tool', '{"a": 1}'),               # tag cut off inside
]
MALFORMED = [
    'before <tool_call>\n{"name": oops}\n</tool_call> after',            # bad JSON: stays content
    'x <tool_call>\n{"arguments": {}}\n</tool_call>',                    # no name
    '<tool_call>\nplain words\n</tool_call> tail',                       # neither format
    '<tool_call>\n<function=bad name\n>\n</function>\n</tool_call>',     # a name over a newline
    'cut <tool_call>\n{"name": ',                                         # cut off before the name is complete
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',            # a name that is not a string
    '<tool_call>\n{"name": " ", "arguments": {}}\n</tool_call>',          # a blank name
    '<tool_call>{"arguments": {"a": 1}, "name": tru}</tool_call>',        # arguments first, then the JSON breaks
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',                     # arguments first, no name at all
    '<tool_call>\n{"name" "noop"}\n</tool_call>',                         # no colon
    'a lone <tool_ at the end <tool_',                                    # prefixes of the tag that never complete
    'a < b and <tool_call> opened but never closed',
]
TEXTS = [JSON_TWO, XML_ONE, XML_TWO, "Plain answer,\n no calls.  \n", "", *MALFORMED,
         '<tool_call>\n{"name": "noop", "arguments": "{\\"k\\": 1}"}\n</tool_call>',        # arguments as a string
         '<tool_call>\n{"name": "noop", "arguments": {"k": 1}}',                            # closing tag cut off
         JSON_LONG, JSON_REORDERED, JSON_PRETTY, *(text for text, _ in BROKEN_AFTER_NAME),
         '<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n4',  # cut
         '<tool_call>\n<function=noop>\n<parameter=a>\n1\n</parameter>\n</function>\nno close tag after',
         '<tool_call>\n<function=noop>\n</function>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n'
         '</function>\n</tool_call>',                                                     # two functions, one block
         '<tool_call>\n<function=noop>\nstray words <parameter=a>\nv\n</parameter>\n</function>\n</tool_call>',
         '<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n5\n</function>\n</tool_call>',
         '<tool_call>\n<function=noop>\n<parameter=code>\na </parameter-like> <parameter=x> b\n</parameter>\n'
         '</function>\n</tool_call>']


def _stream(text: str, cuts: list[int], tools=TOOLS):
    parser = ToolCallParser(tools)
    content, deltas, pieces = "", [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        out = parser.feed(text[a:b])
        content += out.content
        pieces.append(out.content)
        deltas += out.calls
    out = parser.finish()
    return content + out.content, deltas + out.calls, pieces + [out.content]


def _cuts(text: str, rng: random.Random) -> list[int]:
    if not text:
        return []
    return sorted(rng.sample(range(1, len(text) + 1), rng.randint(0, min(12, len(text)))))


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# --- the two formats ---------------------------------------------------------------------------------------------------

def test_json_calls():
    content, calls = parse_tool_calls(JSON_TWO, TOOLS)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris", "days": 3}), ("noop", {})]
    assert calls[0].arguments == '{"city": "Paris", "days": 3}'
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls) and calls[0].id != calls[1].id
    assert calls[0].to_openai()["type"] == "function"


def test_xml_call_values_follow_the_schema():
    content, calls = parse_tool_calls(XML_ONE, TOOLS)
    assert content == "I will look it up."
    assert _calls(calls) == [("get_weather", {
        "city": "New York", "days": 3, "temp": -2.5, "metric": True, "extra": {"a": [1, 2]}, "hours": [1, 2],
        "note": None, "code": "007", "free": {"x": 1}, "unlisted": "12"})]


def test_xml_multiline_strings_and_several_calls():
    content, calls = parse_tool_calls(XML_TWO, TOOLS)
    # Only the newline the template writes on each side of a value is dropped: the value's own stay.
    assert _calls(calls) == [("get_weather", {"city": "line one\nline two\n"}), ("noop", {})]
    assert content == "Done."


@pytest.mark.parametrize("text, schema, value", [
    ("42", {"type": "integer"}, 42), ("4.0", {"type": "integer"}, "4.0"), ("1e3", {"type": "number"}, 1000.0),
    ("abc", {"type": "number"}, "abc"), ("FALSE", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
    ("None", {"type": "null"}, None), ("{'a': True}", {"type": "object"}, {"a": True}),
    ("[1, 'x']", {"type": "array"}, [1, "x"]), ("[1", {"type": "array"}, "[1"), ("{}", {"type": "array"}, "{}"),
    (" 12 ", {"type": "string"}, " 12 "), ("true", {"type": "string"}, "true"),
    ("3", {"type": ["integer", "string"]}, 3), ("x", {"type": ["integer", "string"]}, "x"),
    ("7", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 7), ("[2]", {}, [2]), ("word", {}, "word"),
])
def test_value_conversion(text, schema, value):
    got = convert_value(text, schema)
    assert got == value and type(got) is type(value)


def test_unknown_parameter_and_function_keep_text():
    assert convert_value("12", None, known=False) == "12"
    _, calls = parse_tool_calls("<tool_call>\n<function=elsewhere>\n<parameter=n>\n12\n</parameter>\n</function>\n"
                                "</tool_call>", TOOLS)
    assert _calls(calls) == [("elsewhere", {"n": "12"})]   # a call to an unknown function is still a call


# --- malformed and cut-off markup ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_markup_stays_content(text):
    content, calls = parse_tool_calls(text, TOOLS)
    assert calls == [] and content == text


@pytest.mark.parametrize("text, arguments", BROKEN_AFTER_NAME)
def test_json_body_broken_after_the_name(text, arguments):
    """The name went out before the body broke: the call stays, closed with the well-formed part of its arguments
    (valid JSON), and no text is lost: the block is content too."""
    content, calls = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("noop", arguments)] and content == text
    json.loads(arguments)


def test_cut_off_calls():
    _, calls = parse_tool_calls('<tool_call>\n{"name": "noop", "arguments": {"k": 1}}', TOOLS)
    assert _calls(calls) == [("noop", {"k": 1})]         # the JSON is whole: only the closing tag is missing
    _, calls = parse_tool_calls(TEXTS[-6], TOOLS)
    assert _calls(calls) == [("get_weather", {"city": "Rome"})]   # the cut-off parameter is dropped
    content, calls = parse_tool_calls(TEXTS[-5], TOOLS)
    assert _calls(calls) == [("noop", {"a": "1"})] and content == "no close tag after"


def test_two_functions_in_one_block_and_stray_text():
    _, calls = parse_tool_calls(TEXTS[-4], TOOLS)
    assert _calls(calls) == [("noop", {}), ("get_weather", {"days": 2})]
    _, calls = parse_tool_calls(TEXTS[-3], TOOLS)
    assert _calls(calls) == [("noop", {"a": "v"})]


def test_missing_parameter_close_tags():
    _, calls = parse_tool_calls(TEXTS[-2], TOOLS)
    assert _calls(calls) == [("get_weather", {"city": "Oslo", "days": 5})]
    _, calls = parse_tool_calls(TEXTS[-1], TOOLS)   # tag-like text inside a value on one line stays in it
    assert _calls(calls) == [("noop", {"code": "a </parameter-like> <parameter=x> b"})]


# --- streaming agrees with the whole text ----------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_stream_agrees_with_whole_text_for_any_split(text):
    content, calls = parse_tool_calls(text, TOOLS)
    rng = random.Random(hash(text) & 0xFFFF)
    splits = [list(range(1, len(text))), []] + [_cuts(text, rng) for _ in range(150)]
    for cuts in splits:
        got, deltas, pieces = _stream(text, cuts)
        assert got == content
        joined = join_deltas(deltas)
        assert [(c.name, c.arguments) for c in joined] == [(c.name, c.arguments) for c in calls]
        for d in deltas:   # the first delta of a call names it, the others only carry arguments
            assert (d.name is None) == (d.id is None)
        for c in joined:   # whatever happened, the arguments are one JSON object
            assert isinstance(json.loads(c.arguments), dict)
        if "<" not in content:   # no markup, not even a partial tag, ever leaks into a content piece
            assert all("<" not in p for p in pieces)


# Token-like pieces: the special tokens whole, words with their leading space, digits one by one, punctuation runs
# (Qwen's pre-tokenizer, roughly), each then cut in one to three sub-word pieces.
_PRETOKEN = re.compile(r"</?tool_call>|</?think>| ?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+")


def _token_cuts(text: str, rng: random.Random) -> list[int]:
    cuts = []
    for m in _PRETOKEN.finditer(text):
        a, b = m.span()
        inner = sorted(rng.sample(range(a + 1, b), min(b - a - 1, rng.randint(0, 2))))
        cuts += inner + [b]
    return [c for c in cuts if 0 < c < len(text)]


@pytest.mark.parametrize("text", [JSON_LONG, JSON_REORDERED, JSON_PRETTY, JSON_TWO, *MALFORMED[:6],
                                  *(t for t, _ in BROKEN_AFTER_NAME)])
def test_json_stream_agrees_over_many_seeds_and_token_splits(text):
    content, calls = parse_tool_calls(text, TOOLS)
    expected = [(c.name, c.arguments) for c in calls]
    for seed in range(40):
        rng = random.Random(seed)
        for cuts in (_token_cuts(text, rng), _cuts(text, rng)):
            got, deltas, _ = _stream(text, cuts)
            assert got == content and [(c.name, c.arguments) for c in join_deltas(deltas)] == expected


def test_json_arguments_are_the_model_text():
    """The arguments string is the model's text of the object, verbatim (its escapes and spacing kept)."""
    _, calls = parse_tool_calls(JSON_LONG, TOOLS)
    start = JSON_LONG.index('{"city"')
    assert calls[0].arguments == JSON_LONG[start:JSON_LONG.rindex("}}") + 1]
    assert json.loads(calls[0].arguments)["extra"]["emoji"] == "\U0001F600 日本 é"
    _, calls = parse_tool_calls(JSON_REORDERED, TOOLS)   # "parameters" first: it counts; keys after the name too
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Lima", "days": 2}'),
                                                      ("noop", "{}")]
    _, calls = parse_tool_calls(JSON_PRETTY, TOOLS)
    assert calls[0].arguments == JSON_PRETTY[JSON_PRETTY.index('{\n    "a"'):JSON_PRETTY.rindex("}\n}") + 1]
    _, calls = parse_tool_calls('<tool_call>{"name": "noop", "arguments": " {\\"k\\": [1]} "}</tool_call>', TOOLS)
    assert calls[0].arguments == '{"k": [1]}'   # arguments as a string: its value, whitespace around it dropped


def test_json_arguments_stream_before_the_closing_tag():
    """Fed token by token, the name goes out when its string closes and the arguments in many pieces before
    </tool_call> arrives; all of them once the arguments object closed."""
    body_end = JSON_LONG.index("\n</tool_call>")
    parser = ToolCallParser(TOOLS)
    deltas, name_at = [], None
    for a, b in zip([0, *_token_cuts(JSON_LONG[:body_end], random.Random(1))],
                    [*_token_cuts(JSON_LONG[:body_end], random.Random(1)), body_end]):
        new = parser.feed(JSON_LONG[a:b]).calls
        if name_at is None and new:
            name_at = b
            assert new[0].name == "get_weather" and JSON_LONG[:b].endswith('"get_weather"')
        deltas += new
    fragments = [d.arguments for d in deltas if d.name is None]
    assert len(fragments) >= 20
    _, calls = parse_tool_calls(JSON_LONG, TOOLS)
    assert "".join(fragments) == calls[0].arguments   # everything, before the closing tag
    assert parser.feed("\n</tool_call>").calls == []


def test_json_stream_holds_back_what_may_change():
    parser = ToolCallParser(TOOLS)
    assert parser.feed('<tool_call>\n{"name": "get_wea').calls == []
    head = parser.feed('ther", "arguments": {"days": 1').calls
    assert [(d.name, d.arguments) for d in head] == [("get_weather", ""), (None, "{")]   # 1 may become 12
    assert [d.arguments for d in parser.feed('2, "city": "Os').calls] == ['"days": 12, "city": "Os']
    assert [d.arguments for d in parser.feed('lo \\u00').calls] == ["lo "]        # an escape goes out whole
    assert [d.arguments for d in parser.feed('e9"').calls] == ['\\u00e9"']
    assert [d.arguments for d in parser.feed(', "x').calls] == []                  # a key is held
    assert [d.arguments for d in parser.feed('": [tr').calls] == [', "x": [']       # a literal too
    assert [d.arguments for d in parser.feed('ue]}').calls] == ["true]}"]
    assert parser.feed("}\n</tool_").calls == [] and parser.feed("call>").content == ""


def test_json_arguments_before_the_name_wait_for_it():
    parser = ToolCallParser(TOOLS)
    assert parser.feed('<tool_call>\n{"arguments": {"city": "Oslo", "days": 2}, ').calls == []
    got = parser.feed('"name": "get_weather"').calls
    assert [(d.name, d.arguments) for d in got] == [("get_weather", ""), (None, '{"city": "Oslo", "days": 2}')]
    assert parser.feed("}\n</tool_call>").calls == []


def test_json_broken_after_streaming_closes_the_call():
    parser = ToolCallParser(TOOLS)
    first = parser.feed('Hi <tool_call>\n{"name": "noop", "arguments": {"a": [1, {"b": "x')
    sent = first.calls
    assert [d.arguments for d in sent] == ["", '{"a": [1, {"b": "x'] and first.content == "Hi"
    broken = parser.feed('\u0007"}]}}\n')   # \u0007 raw: not JSON
    assert [d.arguments for d in broken.calls] == ['"}]}'] and broken.content == ""
    json.loads("".join(d.arguments for d in sent + broken.calls))
    end = parser.feed("</tool_call> bye")
    assert end.calls == [] and end.content == ' <tool_call>\n{"name": "noop", "arguments": {"a": [1, {"b": "x\x07"}]}}' \
        '\n</tool_call> bye'


def test_stream_sends_name_first_then_xml_arguments_per_parameter():
    parser = ToolCallParser(TOOLS)
    head = parser.feed("<tool_call>\n<function=get_weather>\n")
    assert [(d.index, d.name, d.arguments) for d in head.calls] == [(0, "get_weather", "")]
    assert head.calls[0].to_openai()["function"] == {"name": "get_weather", "arguments": ""}
    one = parser.feed("<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2")
    assert [d.arguments for d in one.calls] == ['{"city": "Oslo"']
    rest = parser.feed("\n</parameter>\n</function>\n</tool_call>")
    assert [d.arguments for d in rest.calls] == [', "days": 2', "}"]
    assert rest.calls[0].to_openai() == {"index": 0, "function": {"arguments": ', "days": 2'}}


# --- reasoning ---------------------------------------------------------------------------------------------------------

CALL_IN_THINKING = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>\n")


def _chat_stream(text, think, cuts, max_calls=None):
    parser = ChatOutputParser(think, True, TOOLS, max_calls)
    reasoning = content = ""
    deltas = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        out = parser.feed(text[a:b])
        reasoning, content, deltas = reasoning + out.reasoning, content + out.content, deltas + out.calls
    out = parser.finish()
    return reasoning + out.reasoning, content + out.content, join_deltas(deltas + out.calls)


@pytest.mark.parametrize("text, think, reasoning, content, names", [
    # Qwen3.5: the prompt opened <think>; the call is written inside it and the turn ends there.
    (CALL_IN_THINKING, ThinkState.THINKING, "Let me look.", "", ["get_weather"]),
    (CALL_IN_THINKING + "</think>\n\nSunny.", ThinkState.THINKING, "Let me look.", "Sunny.", ["get_weather"]),
    ("<think>\nPlan.\n</think>\n\n" + JSON_TWO, ThinkState.START, "Plan.", "Let me check.", ["get_weather", "noop"]),
    # A JSON call in the reasoning, then an answer.
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n</think>\n\n'
     "Sunny.", ThinkState.THINKING, "Let me look.", "Sunny.", ["get_weather"]),
    # A JSON call whose name went out, cut off by </think>: the call is closed, its text stays in the reasoning.
    ('Hmm <tool_call>\n{"name": "noop", "arguments": {"a": "b\n</think>\n\nOK', ThinkState.THINKING,
     'Hmm <tool_call>\n{"name": "noop", "arguments": {"a": "b', "OK", ["noop"]),
    # An incomplete block inside the reasoning stays reasoning text.
    ("Hmm <tool_call>\n{\"name\": \n</think>\n\nOK", ThinkState.THINKING, 'Hmm <tool_call>\n{"name": ', "OK", []),
    # Thinking that never ended and holds no call: the whole output is the content (the reasoning parser's rule).
    ("I am still thinking", ThinkState.THINKING, None, "I am still thinking", []),
])
def test_calls_inside_and_after_reasoning(text, think, reasoning, content, names):
    res = parse_chat_output(text, think, True, TOOLS)
    assert (res.reasoning, res.content, [c.name for c in res.calls]) == (reasoning, content, names)
    if res.reasoning is not None:   # the stream splits the same way (it cannot take back reasoning it sent)
        rng = random.Random(7)
        for cuts in [list(range(1, len(text)))] + [_cuts(text, rng) for _ in range(60)]:
            r, c, calls = _chat_stream(text, think, cuts)
            assert (r, c) == (reasoning, content)
            assert [(x.name, x.arguments) for x in calls] == [(x.name, x.arguments) for x in res.calls]


def test_max_calls_keeps_the_first():
    text = CALL_IN_THINKING + "</think>\n\n" + JSON_TWO
    res = parse_chat_output(text, ThinkState.THINKING, True, TOOLS, max_calls=1)
    assert [c.name for c in res.calls] == ["get_weather"] and res.content == "Let me check."
    assert json.loads(res.calls[0].arguments) == {"city": "Paris"}
    for cuts in ([], list(range(1, len(text)))):
        assert [c.name for c in _chat_stream(text, ThinkState.THINKING, cuts, 1)[2]] == ["get_weather"]


def test_no_parsing_leaves_text_alone():
    res = parse_chat_output(JSON_TWO + "  \n", ThinkState.CONTENT, False, TOOLS)
    assert res.content == JSON_TWO + "  \n" and res.calls == [] and res.reasoning is None


# --- tools and tool_choice -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tools, param", [
    ({"type": "function"}, "tools"), (["x"], "tools.0"), ([{"type": "code"}], "tools.0.type"),
    ([{"type": "function"}], "tools.0.function"), ([{"type": "function", "function": {"name": ""}}],
                                                    "tools.0.function.name"),
    ([WEATHER, WEATHER], "tools.1.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools.0.function.description"),
])
def test_bad_tools_name_the_field(tools, param):
    with pytest.raises(ToolSpecError) as err:
        check_tools(tools)
    assert err.value.param == param and str(err.value).startswith(param)


def test_tool_choice_values():
    assert parse_tool_choice(None, TOOLS).mode == "auto"
    assert parse_tool_choice(None, None).mode == "none"
    assert parse_tool_choice("none", None).mode == "none" and not parse_tool_choice("none", TOOLS).parses
    assert parse_tool_choice("required", TOOLS).mode == "required"
    named = parse_tool_choice({"type": "function", "function": {"name": "noop"}}, TOOLS)
    assert (named.mode, named.name) == ("function", "noop")
    for bad, tools in [("auto", None), ("required", []), ("sometimes", TOOLS), (3, TOOLS),
                       ({"type": "function", "function": {"name": "nope"}}, TOOLS),
                       ({"type": "function", "function": {"name": "noop"}}, None), ({"type": "function"}, TOOLS)]:
        with pytest.raises(ToolSpecError) as err:
            parse_tool_choice(bad, tools)
        assert err.value.param == "tool_choice"
    with pytest.raises(ToolSpecError):
        check_parser_for(parse_tool_choice("required", TOOLS), None)
    check_parser_for(parse_tool_choice("auto", TOOLS), None)   # auto without a parser: plain text answers


# --- the format, from the published templates --------------------------------------------------------------------------

def _template(name: str) -> str:
    return (REAL / name / "chat_template.jinja").read_text(encoding="utf-8")


def test_format_from_the_chat_template():
    assert detect_format(_template("Qwen3-8B")) == "qwen-json"
    assert detect_format(_template("Qwen3.8-27B")) == "qwen-xml"
    assert detect_format(builtin_chat_template("qwen3")) == "qwen-json"
    assert detect_format(builtin_chat_template("qwen2")) == "qwen-json"
    assert detect_format("{{ messages[0].content }}") is None and detect_format(None) is None
    assert resolve_format("auto", _template("Qwen3.8-27B")) == "qwen-xml"
    assert resolve_format("qwen-json", _template("Qwen3.8-27B")) == "qwen-json"
    assert resolve_format("none", _template("Qwen3.8-27B")) is None
    with pytest.raises(ConfigError):
        EngineArgs(tool_call_parser="hermes")


@pytest.mark.parametrize("template", ["Qwen3-8B", "Qwen3.8-27B"])
def test_published_template_rendering_parses_back(template):
    """An assistant turn with content and two calls, rendered by the real template, parses back to the same calls
    and content: the parser expects the whitespace the template writes. (Rendering needs no vocabulary.)"""
    tok = Tokenizer(BackendTokenizer(BPE()), {}, {"default": _template(template)})
    args = {"city": "New York", "days": 3, "extra": {"a": [1, "b"]}, "code": "007", "metric": False}
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": args}},
             {"type": "function", "function": {"name": "noop", "arguments": {}}}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "reasoning_content": "Think.", "tool_calls": calls}]
    prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False)
    turn = prompt[prompt.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):prompt.rindex("<|im_end|>")]
    res = parse_chat_output(turn, ThinkState.START, True, TOOLS)
    assert res.reasoning == "Think." and res.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in res.calls] == [("get_weather", args), ("noop", {})]


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "lit", "obj", "arr"] if depth < 3 else ["str", "int", "lit"])
    if kind == "str":
        return "".join(rng.choice('ab "\\\n\té日\U0001F600</>{}[],:') for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-20, 20)
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "obj":
        return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def test_random_json_calls_stream_as_parsed():
    """Random arguments (any spacing, escapes or raw unicode), whole, cut off or with one character corrupted:
    streamed in random pieces they give what the whole text gives, the arguments always parse, and a well-formed
    call's arguments are the model's text, parsing to the object it wrote."""
    rng = random.Random(2024)
    for trial in range(150):
        args = {f"p{i}": _random_value(rng) for i in range(rng.randint(0, 5))}
        spacing = rng.choice([{}, {"separators": (",", ":")}, {"indent": 2}])
        args_text = json.dumps(args, ensure_ascii=rng.random() < 0.5, **spacing)
        text = f'Hi.\n<tool_call>\n{{"name": "get_weather", "arguments": {args_text}}}\n</tool_call>'
        if trial % 3 == 1:
            text = text[:rng.randint(0, len(text))]
        elif trial % 3 == 2:
            at = rng.randrange(len(text))
            text = text[:at] + rng.choice('"\\{}[],: x\n') + text[at + 1:]
        content, calls = parse_tool_calls(text, TOOLS)
        for c in calls:
            assert isinstance(json.loads(c.arguments), dict)
        if trial % 3 == 0:
            assert [(c.name, c.arguments) for c in calls] == [("get_weather", args_text)] and content == "Hi."
            assert json.loads(calls[0].arguments) == args
        for cuts in (_cuts(text, rng), _token_cuts(text, rng)):
            got, deltas, _ = _stream(text, cuts)
            assert got == content
            assert [(c.name, c.arguments) for c in join_deltas(deltas)] == [(c.name, c.arguments) for c in calls]
