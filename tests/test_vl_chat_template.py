"""orinfer's built-in Qwen3-VL chat template against the one Qwen publishes with Qwen3-VL-8B-Instruct.

The reference is read from a directory of real Qwen files ($ORINFER_REAL_QWEN, default /work/shared/real-qwen; see
its SOURCES.md) and rendered by transformers' apply_chat_template; ours is rendered by orinfer.tokenizer.Tokenizer,
as the engine does. The comparison is skipped when the reference is not there; the exact-string tests below it run
everywhere. No model is needed: a tokenizer trained in milliseconds on the bundled text is enough.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from orinfer.tokenizer import Tokenizer, builtin_chat_template
from orinfer.tokenizer_train import bundled_corpus, train_tokenizer

REAL_QWEN = Path(os.environ.get("ORINFER_REAL_QWEN", "/work/shared/real-qwen"))
REFERENCE = REAL_QWEN / "Qwen3-VL-8B-Instruct" / "chat_template.json"

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"

Message = dict[str, Any]


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


def image(source: str) -> dict[str, str]:
    return {"type": "image", "image": source}


TOOLS = [{"type": "function", "function": {"name": "get", "description": "weather",
                                           "parameters": {"type": "object", "properties": {"city": {}}}}}]

CONVERSATIONS: dict[str, list[Message]] = {
    "system_first": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "and?"},
    ],
    "system_after_user": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "and?"},
    ],
    "system_after_assistant": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "and?"},
    ],
    "two_systems": [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "hi"},
    ],
    "only_system": [{"role": "system", "content": "Be brief."}],
    "system_parts_with_image": [
        {"role": "system", "content": [text("Look "), image("s.png"), text("closely.")]},
        {"role": "user", "content": [image("a.png"), text("this?")]},
    ],
    "later_system_parts_with_images": [
        {"role": "user", "content": [image("a.png"), text("this?")]},
        {"role": "system", "content": [image("s.png"), text("Be brief."), {"type": "video", "video": "s.mp4"}]},
        {"role": "user", "content": [text("and "), {"image_url": {"url": "b.png"}}, {"type": "video", "video": "c.mp4"}]},
    ],
    "assistant_parts_with_image": [
        {"role": "user", "content": [image("a.png"), text("this?")]},
        {"role": "assistant", "content": [text("A cat, like "), image("cat.png")]},
        {"role": "user", "content": [image("b.png"), text("and this?")]},
    ],
    "tool_calls_and_image_results": [
        {"role": "system", "content": [text("Use tools.")]},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [image("x.png")], "tool_calls": [
            {"type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": [text("map: "), image("map.png")]},
        {"role": "tool", "content": "20C"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "get", "arguments": '{"city": "Rome"}'}]},
        {"role": "system", "content": "Hidden."},
        {"role": "user", "content": "thanks"},
    ],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained tokenizer whose chat template is our built-in Qwen3-VL one (chat_template.jinja wins over
    tokenizer_config.json, for orinfer and transformers alike)."""
    out = tmp_path_factory.mktemp("tok_qwen3_vl")
    train_tokenizer([bundled_corpus()], 1024, out)
    (out / "chat_template.jinja").write_text(builtin_chat_template("qwen3_vl"), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def ours(tokenizer_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_dir(tokenizer_dir)
    assert tok.chat_template == builtin_chat_template("qwen3_vl")
    return tok


@pytest.fixture(scope="module")
def reference_template() -> str:
    if not REFERENCE.is_file():
        pytest.skip(f"the published Qwen3-VL chat template is not at {REFERENCE} (set ORINFER_REAL_QWEN)")
    return json.loads(REFERENCE.read_text(encoding="utf-8"))["chat_template"]


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_matches_the_published_qwen3_vl_template(ours: Tokenizer, hf_tokenizer: Any, reference_template: str,
                                                 name: str) -> None:
    messages = CONVERSATIONS[name]
    for tools in (None, TOOLS):
        for add_vision_id in (False, True):
            for add_generation_prompt in (True, False):
                options = dict(tools=tools, add_generation_prompt=add_generation_prompt, add_vision_id=add_vision_id)
                expected = hf_tokenizer.apply_chat_template(messages, chat_template=reference_template,
                                                            tokenize=False, **options)
                assert ours.apply_chat_template(messages, **options) == expected, options


def test_later_system_message_is_left_out(ours: Tokenizer) -> None:
    assert ours.apply_chat_template(CONVERSATIONS["system_after_user"]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n")
    assert ours.apply_chat_template(CONVERSATIONS["two_systems"]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_system_and_assistant_keep_only_text_parts(ours: Tokenizer) -> None:
    assert ours.apply_chat_template(CONVERSATIONS["system_parts_with_image"], add_vision_id=True) == (
        "<|im_start|>system\nLook closely.<|im_end|>\n<|im_start|>user\nPicture 1: " + IMAGE + "this?<|im_end|>\n"
        "<|im_start|>assistant\n")
    # Images of left-out parts and messages are not counted either: numbering goes on from the user's images.
    assert ours.apply_chat_template(CONVERSATIONS["later_system_parts_with_images"], add_vision_id=True) == (
        "<|im_start|>user\nPicture 1: " + IMAGE + "this?<|im_end|>\n<|im_start|>user\nand Picture 2: " + IMAGE +
        "Video 1: " + VIDEO + "<|im_end|>\n<|im_start|>assistant\n")
    assert ours.apply_chat_template(CONVERSATIONS["assistant_parts_with_image"], add_generation_prompt=False) == (
        "<|im_start|>user\n" + IMAGE + "this?<|im_end|>\n<|im_start|>assistant\nA cat, like <|im_end|>\n"
        "<|im_start|>user\n" + IMAGE + "and this?<|im_end|>\n")


@pytest.mark.parametrize("role", ["system", "assistant"])
def test_an_image_outside_user_and_tool_messages_is_a_clear_error(role):
    """The template shows the model no image in a system or assistant message, so one there would leave an image
    without its placeholder: refused up front, naming the part."""
    from orinfer.errors import RequestError
    from orinfer.prompt_inputs import split_chat

    messages = [{"role": role, "content": [text("Look "), image("s.png")]}, {"role": "user", "content": "hi"}]
    with pytest.raises(RequestError, match=r"messages\[0\]\.content\[1\].*user or tool"):
        split_chat(messages, multimodal=True)
    ok = [{"role": "user", "content": [image("a.png")]}, {"role": "tool", "content": [image("b.png"), text("x")]}]
    assert split_chat(ok, multimodal=True)[1] == ["a.png", "b.png"]
