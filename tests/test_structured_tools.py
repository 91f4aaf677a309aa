"""tool_call_constraint: the grammars that force tool calls accept the calls Qwen's own chat templates render (Qwen3's
JSON format, Qwen3.5's XML one) and refuse anything else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orinfer.errors import RequestError
from orinfer.structured.constraint import SequenceConstraint
from orinfer.structured.grammar import GrammarCompiler
from orinfer.structured.tool_calls import tool_call_constraint
from orinfer.tokenizer import Tokenizer
from orinfer.tokenizer_train import bundled_corpus, train_tokenizer

XML_TEMPLATE = Path(__file__).parent / "data" / "real-qwen" / "Qwen3.8-27B" / "chat_template.jinja"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "detail": {"type": "object", "properties": {"hourly": {"type": "boolean"}}, "required": ["hourly"]}},
            "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
CALLS = [
    [("get_weather", {"city": "Paris", "days": 3})],
    [("get_weather", {"city": "New York\n<b>NYC</b>", "days": 10, "unit": "fahrenheit", "detail": {"hourly": True}})],
    [("now", {})],
    [("get_weather", {"city": "Rome", "days": 1}), ("now", {})],
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Qwen3's bundled template (JSON calls) and the published Qwen3.5-family template (XML calls), over one trained
    tokenizer with Qwen's added tokens (<tool_call> is one token)."""
    json_dir = tmp_path_factory.mktemp("tok_json")
    json_tok = train_tokenizer([bundled_corpus()], 1024, json_dir)
    xml_dir = tmp_path_factory.mktemp("tok_xml")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(json_dir / name, xml_dir / name)
    (xml_dir / "chat_template.jinja").write_text(XML_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    return {"qwen-json": json_tok, "qwen-xml": Tokenizer.from_dir(xml_dir)}


@pytest.fixture(scope="module")
def compiler(tokenizers):
    tok = tokenizers["qwen-json"]
    return GrammarCompiler(tok.to_json(), tok._backend.get_vocab_size(),
                           [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])


def rendered_calls(tok: Tokenizer, calls: list[tuple[str, dict]]) -> str:
    """The assistant turn's tool calls exactly as the template writes them."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, tools=TOOLS)
    turn = text[text.rindex("<|im_start|>assistant\n"):]
    return turn[turn.index("<tool_call>"):turn.rindex("<|im_end|>")]


def accepted(compiler: GrammarCompiler, tok: Tokenizer, spec, text: str) -> bool:
    c = SequenceConstraint(compiler.matcher(spec))
    return all(c.advance(t) for t in tok.encode(text)) and c.matcher.is_accepting()


@pytest.mark.parametrize("fmt", ["qwen-json", "qwen-xml"])
@pytest.mark.parametrize("calls", CALLS, ids=["required", "all-params", "no-params", "parallel"])
def test_template_rendered_calls_are_accepted(compiler, tokenizers, fmt, calls):
    tok = tokenizers[fmt]
    text = rendered_calls(tok, calls)
    assert text.startswith("<tool_call>\n") and text.endswith("</tool_call>")
    assert accepted(compiler, tok, tool_call_constraint(fmt, TOOLS), text), text
    if len(calls) > 1:
        assert not accepted(compiler, tok, tool_call_constraint(fmt, TOOLS, parallel=False), text)
    else:
        assert accepted(compiler, tok, tool_call_constraint(fmt, TOOLS, name=calls[0][0]), text)
        other = "now" if calls[0][0] != "now" else "get_weather"
        assert not accepted(compiler, tok, tool_call_constraint(fmt, TOOLS, name=other), text)


@pytest.mark.parametrize("fmt", ["qwen-json", "qwen-xml"])
@pytest.mark.parametrize("calls", [
    [("get_weather", {"city": "Paris"})],                         # a required parameter missing
    [("get_weather", {"city": "Paris", "days": "three"})],        # a string where an integer is due
    [("get_weather", {"city": "Paris", "days": 3, "unit": "K"})],  # not in the enum
    [("get_weather", {"city": "Paris", "days": 0})],              # below the minimum
    [("lookup", {"q": "x"})],                                     # not a tool
], ids=["missing", "type", "enum", "minimum", "unknown-tool"])
def test_invalid_calls_are_refused(compiler, tokenizers, fmt, calls):
    tok = tokenizers[fmt]
    assert not accepted(compiler, tok, tool_call_constraint(fmt, TOOLS), rendered_calls(tok, calls))


@pytest.mark.parametrize("fmt", ["qwen-json", "qwen-xml"])
def test_text_around_the_calls_is_refused(compiler, tokenizers, fmt):
    tok = tokenizers[fmt]
    text = rendered_calls(tok, CALLS[0])
    spec = tool_call_constraint(fmt, TOOLS)
    assert not accepted(compiler, tok, spec, "Sure. " + text)
    assert not accepted(compiler, tok, spec, text + " done")
    assert not accepted(compiler, tok, spec, text[:-len("</tool_call>")])  # unfinished


def test_bad_arguments_are_clear_errors():
    with pytest.raises(RequestError, match="unknown tool-call format"):
        tool_call_constraint("hermes", TOOLS)
    with pytest.raises(RequestError, match="tools is empty"):
        tool_call_constraint("qwen-json", [])
    with pytest.raises(RequestError, match="tool_choice names 'nope'"):
        tool_call_constraint("qwen-json", TOOLS, name="nope")
    with pytest.raises(RequestError, match=r"tools\[0\] needs a function with a name"):
        tool_call_constraint("qwen-xml", [{"type": "function", "function": {"parameters": {}}}])


def test_json_arguments_parse(compiler, tokenizers):
    """What the JSON grammar accepts is what the tool-call parser will read: one JSON object per call."""
    tok = tokenizers["qwen-json"]
    text = rendered_calls(tok, CALLS[3])
    bodies = [part.split("</tool_call>")[0].strip() for part in text.split("<tool_call>")[1:]]
    assert [json.loads(b)["name"] for b in bodies] == ["get_weather", "now"]
