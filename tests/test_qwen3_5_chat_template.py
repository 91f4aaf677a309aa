"""The Qwen3.5 / 3.6 / 3.8 chat template rendered by orinfer exactly as transformers' apply_chat_template renders it.

The reference is the template Qwen publishes with Qwen3.8-27B, copied byte for byte into
tests/data/real-qwen/Qwen3.8-27B/chat_template.jinja (its origin: ../shared/real-qwen/SOURCES.md), so the comparison
runs wherever the repository does. transformers renders it as the reference; ours is orinfer.tokenizer.Tokenizer
loading the same file from a model directory, as the engine does. No model is needed: a tokenizer trained in
milliseconds on the bundled text is enough (the template uses no tokenizer-specific variables).

What the template reads, and so what is varied below: `enable_thinking` (absent / true / false), `preserve_thinking`
(absent / true / false: whether the reasoning of assistant turns before the last user query is kept),
`reasoning_effort` (xhigh / medium / low, else an error), `add_vision_id`, `tools` (a JSON list in the system prompt
and XML `<tool_call><function=...><parameter=...>` calls in assistant turns), `reasoning_content`, `tool_calls` and the
`tool` role, image / video content parts, and `add_generation_prompt`. Conversations the template refuses (it raises)
must be refused by both, with the template's message.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from orinfer.tokenizer import Tokenizer, TokenizerError
from orinfer.tokenizer_train import bundled_corpus, train_tokenizer

TEMPLATE_FILE = Path(__file__).parent / "data" / "real-qwen" / "Qwen3.8-27B" / "chat_template.jinja"
# sha256 of the published file (SOURCES.md lists its first 16 digits): the fixture must stay the real template.
TEMPLATE_SHA256 = "c3cf9e34abf4f9e36c2d72165aa9c132d3e2a725b6c2586aaa3a8af9d7a81041"

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
XHIGH = ("Reasoning effort is set to xhigh. Please think carefully through the task, validate key assumptions, "
         "consider plausible alternatives, and prioritize correctness, consistency, and clarity in the final answer.")

Message = dict[str, Any]

# Tools with characters json.dumps and jinja's own tojson treat differently ('<', '&', non-ASCII), so a renderer that
# HTML-escapes or ASCII-escapes them would differ.
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current température in a city <b>&</b>",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {}}},
]


def call(name: str, arguments: Any, wrapped: bool = True) -> dict[str, Any]:
    """An assistant tool call, OpenAI-style ({"type": "function", "function": {...}}) or bare ({"name", ...})."""
    function = {"name": name, "arguments": arguments}
    return {"type": "function", "id": f"call_{name}", "function": function} if wrapped else function


def text(value: str) -> dict[str, str]:
    """A text content part."""
    return {"type": "text", "text": value}


CONVERSATIONS: dict[str, list[Message]] = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system": [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "Hi"}],
    "empty_system": [{"role": "system", "content": "  "}, {"role": "user", "content": "Hi"}],
    "system_as_parts": [{"role": "system", "content": [text("Be "), text("brief.")]},
                        {"role": "user", "content": "Hi"}],
    "multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6."},
        {"role": "user", "content": "And 4+4?"},
    ],
    "reasoning_content_in_history": [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "Seven.", "reasoning_content": "\nAny number works.\n"},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "\nIt is prime.\n", "reasoning_content": "Explain."},
        {"role": "user", "content": "Thanks."},
    ],
    "reasoning_content_last_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets me."},
    ],
    "reasoning_content_not_a_string": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": None},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!"},
    ],
    "think_tags_in_content": [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "<think>\nAny number works.\n</think>\n\nSeven."},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "<think>\nBecause.\n</think>\n\nIt is prime."},
    ],
    "text_that_looks_like_markup": [
        {"role": "user", "content": "Render {{ x }} and {% if %} and <b>&amp;</b> 😀"},
        {"role": "assistant", "content": "{{ x }} <i>&</i>"},
        {"role": "user", "content": "ok"},
    ],
    "tool_call_dict_arguments": [
        {"role": "system", "content": "Use tools when helpful."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [
            call("get_weather", {"city": "Zürich", "unit": "celsius", "days": 3, "exact": True, "hours": [1, 2],
                                 "where": {"lat": 47.4, "name": "<Zürich> & co"}, "note": "two\nlines",
                                 "nothing": None})]},
        {"role": "tool", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": "It is 21 °C.", "reasoning_content": "Report it."},
        {"role": "user", "content": "Thanks."},
    ],
    "tool_calls_with_text_and_consecutive_responses": [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "Let me check both.", "tool_calls": [
            call("get_weather", {"city": "Paris"}), call("now", {}, wrapped=False)]},
        {"role": "tool", "content": "20C"},
        {"role": "tool", "content": "  12:00  "},
        {"role": "user", "content": "And Rome?"},
    ],
    "tool_calls_without_arguments": [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            call("now", ""), {"type": "function", "function": {"name": "now"}}]},
        {"role": "tool", "content": "12:00"},
    ],
    "multi_step_tools_ending_in_a_tool_response": [
        {"role": "user", "content": "Weather in Paris, then Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "Paris first.",
         "tool_calls": [call("get_weather", {"city": "Paris"})]},
        {"role": "tool", "content": "20C"},
        {"role": "assistant", "content": "", "reasoning_content": "Now Rome.",
         "tool_calls": [call("get_weather", {"city": "Rome"})]},
        {"role": "tool", "content": [text("25C")]},
    ],
    "tool_response_written_as_a_user_message": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask.", "tool_calls": [call("now", {})]},
        {"role": "user", "content": " <tool_response>\n12:00\n</tool_response> "},
    ],
    "images_and_videos": [
        {"role": "system", "content": "Describe."},
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, text("this and "),
                                     {"type": "image_url", "image_url": {"url": "b.png"}}, {"image": "c.png"}]},
        # Unlike Qwen3-VL's template, this one renders (and counts) an image in an assistant message too.
        {"role": "assistant", "content": [text("Two cats, like "), {"type": "image", "image": "cat.png"}],
         "reasoning_content": "Look."},
        {"role": "user", "content": [{"type": "video", "video": "v.mp4"}, {"video": ["f1.png", "f2.png"]},
                                     text("and these?")]},
        {"role": "assistant", "content": "", "tool_calls": [call("now", {})]},
        {"role": "tool", "content": [{"type": "image", "image": "map.png"}, text("a map")]},
        {"role": "user", "content": [text("ok")]},
    ],
}

# Conversations the template refuses, with (part of) its message. Each must be refused by both renderers.
REFUSED: dict[str, tuple[list[Message], dict[str, Any], str]] = {
    "only_system": ([{"role": "system", "content": "Be brief."}], {}, "No user query found in messages."),
    "only_tool_responses_as_user": ([{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}], {},
                                    "No user query found in messages."),
    "system_not_first": ([{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late."}], {},
                         "System message must be at the beginning."),
    "image_in_system": ([{"role": "system", "content": [{"type": "image", "image": "a.png"}]},
                         {"role": "user", "content": "Hi"}], {}, "System message cannot contain images."),
    "video_in_system": ([{"role": "system", "content": [{"type": "video", "video": "a.mp4"}]},
                         {"role": "user", "content": "Hi"}], {}, "System message cannot contain videos."),
    "unknown_role": ([{"role": "user", "content": "Hi"}, {"role": "developer", "content": "x"}], {},
                     "Unexpected message role."),
    "unknown_part": ([{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}], {},
                     "Unexpected item type in content."),
    "content_a_mapping": ([{"role": "user", "content": {"text": "Hi"}}], {}, "Unexpected content type."),
    "bad_reasoning_effort": ([{"role": "user", "content": "Hi"}], {"reasoning_effort": "high"},
                             "Unexpected reasoning effort high."),
    # The template iterates `arguments|items`, which needs a mapping: OpenAI-style JSON-string arguments fail in
    # transformers too (a caller that has them must json.loads them first, as vLLM's server does).
    "json_string_arguments": ([{"role": "user", "content": "Weather?"},
                               {"role": "assistant", "content": "", "tool_calls": [
                                   call("get_weather", '{"city": "Paris"}')]}], {},
                              "Can only get item pairs from a mapping."),
}

ABSENT = object()  # an option left out of the call altogether (the template sees it undefined)


@pytest.fixture(scope="module")
def template() -> str:
    """The published template, checked to be the exact file Qwen publishes."""
    raw = TEMPLATE_FILE.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == TEMPLATE_SHA256, f"{TEMPLATE_FILE} is not the published template"
    return raw.decode("utf-8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, template: str) -> Path:
    """A trained tokenizer with the published template as chat_template.jinja, where a checkpoint keeps it."""
    out = tmp_path_factory.mktemp("tok_qwen3_5")
    train_tokenizer([bundled_corpus()], 1024, out)
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def ours(model_dir: Path, template: str) -> Tokenizer:
    """orinfer's tokenizer of that directory (it must pick the template file over tokenizer_config.json's)."""
    tok = Tokenizer.from_dir(model_dir)
    assert tok.chat_template == template
    return tok


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    """transformers' tokenizer of the same directory: the reference renderer."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def render_both(ours: Tokenizer, hf: Any, template: str, messages: list[Message],
                options: dict[str, Any]) -> tuple[str, str]:
    """(orinfer's rendering, transformers') of `messages` with `options`; ABSENT values are not passed at all."""
    given = {key: value for key, value in options.items() if value is not ABSENT}
    expected = hf.apply_chat_template(messages, chat_template=template, tokenize=False, **given)
    return ours.apply_chat_template(messages, **given), expected


def option_grid(**choices: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Every combination of the given option values."""
    return [dict(zip(choices, values)) for values in itertools.product(*choices.values())]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_matches_transformers(ours: Tokenizer, hf: Any, template: str, name: str) -> None:
    """Every conversation, in every combination of thinking, preserve_thinking, tools and generation prompt."""
    # preserve_thinking=None is passed as it is by both (the template then drops earlier reasoning).
    grid = option_grid(enable_thinking=(ABSENT, True, False), preserve_thinking=(ABSENT, True, False, None),
                       tools=(None, [], TOOLS), add_generation_prompt=(True, False))
    renders = set()
    for options in grid:
        got, expected = render_both(ours, hf, template, CONVERSATIONS[name], options)
        assert got == expected, options
        renders.add(got)
    # The options reached the template: at least thinking on/off, tools and the generation prompt change the text.
    assert len(renders) >= 8


@pytest.mark.parametrize("name", ["multi_turn", "images_and_videos", "tool_call_dict_arguments"])
def test_reasoning_effort_and_vision_ids_match_transformers(ours: Tokenizer, hf: Any, template: str,
                                                            name: str) -> None:
    """reasoning_effort (which only applies while thinking) and add_vision_id, the template's other variables."""
    grid = option_grid(reasoning_effort=(ABSENT, "xhigh", "medium", "low"), enable_thinking=(ABSENT, False),
                       add_vision_id=(ABSENT, False, True), tools=(None, TOOLS), add_generation_prompt=(True,))
    # Without thinking the template does not look at reasoning_effort, so an unknown one is no error there.
    grid += option_grid(reasoning_effort=("high",), enable_thinking=(False,), add_vision_id=(ABSENT,),
                        tools=(None, TOOLS), add_generation_prompt=(True, False))
    for options in grid:
        got, expected = render_both(ours, hf, template, CONVERSATIONS[name], options)
        assert got == expected, options


def test_enable_thinking_none_is_the_model_default(ours: Tokenizer, hf: Any, template: str) -> None:
    """orinfer's enable_thinking=None (what the server passes when a request sets none) means "not passed": the
    template's default, thinking with xhigh effort. transformers given an explicit None would define the variable
    as None instead, which this template reads as neither on nor off."""
    for messages in (CONVERSATIONS["single_user"], CONVERSATIONS["reasoning_content_in_history"]):
        expected = hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, enable_thinking=None) == expected
        assert XHIGH in expected


def test_template_from_tokenizer_config(model_dir: Path, template: str, tmp_path: Path) -> None:
    """The published checkpoints carry the template only in tokenizer_config.json: both read it from there."""
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = template
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(model_dir / name, tmp_path / name)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    assert Tokenizer.from_dir(tmp_path).chat_template == template
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path)).chat_template == template


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_like_transformers(ours: Tokenizer, hf: Any, template: str, name: str) -> None:
    """What the template refuses, both refuse, with the template's message (ours as a TokenizerError)."""
    messages, options, message = REFUSED[name]
    with pytest.raises(Exception, match=message) as reference:
        hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True,
                               **options)
    with pytest.raises(TokenizerError) as got:
        ours.apply_chat_template(messages, add_generation_prompt=True, **options)
    assert str(reference.value) in str(got.value)


# Exact strings, independent of transformers: what the published template's behaviour is, so that a change to the
# renderer (or to the fixture) that transformers would share still shows up here.

def test_thinking_prompt_and_default_reasoning_effort(ours: Tokenizer) -> None:
    """Thinking is on unless enable_thinking is false; then the prompt closes an empty think block."""
    hi = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(hi) == (
        f"<|im_start|>system\n{XHIGH}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert ours.apply_chat_template(hi, enable_thinking=True) == ours.apply_chat_template(hi)
    assert ours.apply_chat_template(hi, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # "medium" is accepted and adds no instructions.
    assert ours.apply_chat_template(hi, reasoning_effort="medium") == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_preserve_thinking(ours: Tokenizer) -> None:
    """Reasoning before the last user query is kept unless preserve_thinking is false; after it, always."""
    messages = CONVERSATIONS["reasoning_content_in_history"][:4]
    kept = ours.apply_chat_template(messages, enable_thinking=False, add_generation_prompt=False)
    assert kept == (
        "<|im_start|>user\nPick a number.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAny number works.\n</think>\n\nSeven.<|im_end|>\n"
        "<|im_start|>user\nWhy?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nExplain.\n</think>\n\nIt is prime.<|im_end|>\n")
    dropped = ours.apply_chat_template(messages, enable_thinking=False, add_generation_prompt=False,
                                       preserve_thinking=False)
    assert dropped == kept.replace("<think>\nAny number works.\n</think>\n\n", "")
    assert ours.apply_chat_template(messages, enable_thinking=False, add_generation_prompt=False,
                                    preserve_thinking=True) == kept


def test_tools_and_xml_tool_calls(ours: Tokenizer) -> None:
    """Tools as plain JSON lines (no HTML or ASCII escaping), calls as XML with string values unquoted."""
    messages = CONVERSATIONS["tool_calls_with_text_and_consecutive_responses"]
    out = ours.apply_chat_template(messages, tools=TOOLS, enable_thinking=False, preserve_thinking=False)
    assert out.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                          '{"type": "function", "function": {"name": "get_weather", "description": "Current '
                          'température in a city <b>&</b>", ')
    assert "\n</tools>\n\nIf you choose to call a function ONLY reply" in out
    assert out.endswith(
        "</IMPORTANT><|im_end|>\n<|im_start|>user\nWeather in Paris and the time?<|im_end|>\n"
        "<|im_start|>assistant\nLet me check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n20C\n</tool_response>\n<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nAnd Rome?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    args = ours.apply_chat_template(CONVERSATIONS["tool_call_dict_arguments"], enable_thinking=False)
    # Non-string values are JSON (true, null, lists, nested objects unescaped); strings are written as they are.
    assert ("<parameter=days>\n3\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n"
            '</parameter>\n<parameter=where>\n{"lat": 47.4, "name": "<Zürich> & co"}\n</parameter>\n'
            "<parameter=note>\ntwo\nlines\n</parameter>\n<parameter=nothing>\nnull\n</parameter>\n") in args


def test_images_and_videos(ours: Tokenizer) -> None:
    """One placeholder per image / video part, numbered across the conversation with add_vision_id."""
    messages = CONVERSATIONS["images_and_videos"]
    out = ours.apply_chat_template(messages, add_vision_id=True, enable_thinking=False)
    assert f"<|im_start|>user\nPicture 1: {IMAGE}this and Picture 2: {IMAGE}Picture 3: {IMAGE}<|im_end|>" in out
    assert f"<|im_start|>user\nVideo 1: {VIDEO}Video 2: {VIDEO}and these?<|im_end|>" in out
    assert f"<|im_start|>assistant\n<think>\nLook.\n</think>\n\nTwo cats, like Picture 4: {IMAGE}<|im_end|>" in out
    assert f"<tool_response>\nPicture 5: {IMAGE}a map\n</tool_response>" in out
    assert ours.apply_chat_template(messages, enable_thinking=False).count(IMAGE) == 5
