"""Tests for orinfer.tokenizer and orinfer.tokenizer_train, checked against Hugging Face transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orinfer.tokenizer import RELEASE_LOCK_CHARS, Tokenizer, TokenizerError
from orinfer.tokenizer_train import QWEN_SPECIAL_TOKENS, bundled_corpus, qwen_added_tokens, train_tokenizer

VOCAB_SIZE = 1024
ARCHES = ("qwen3", "qwen2")

# Texts that exercise the pre-tokenizer: special tokens, multi-byte characters, digits, whitespace runs.
ENCODE_TEXTS = [
    "Alice was beginning to get very tired of sitting by her sister on the bank.",
    "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nLet me think.\n</think>\n\nThe answer is 42.<|endoftext|>",
    "Numbers: 1234567890, 3.14159, -17 and 1e10",
    "  leading spaces,   runs of   spaces,\ttabs\t\tand\n\n\nnewlines\r\nCRLF   \n  ",
    "Café, naïve résumé, Ελληνικά, 你好，世界！ こんにちは 😀👍🏽 🇫🇷 e\u0301 (decomposed)",
    "don't, I'LL, they'Re, it's <tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "",
]
# Long enough for `Tokenizer.encode`'s batch call (RELEASE_LOCK_CHARS), which must give the one-text call's ids.
ENCODE_TEXTS.append("\n".join(ENCODE_TEXTS) * 30)

# Streamed text full of multi-byte characters; the trained vocabulary is ASCII-heavy, so these split
# into several byte tokens each.
MULTIBYTE_TEXT = "Héllo wörld! 你好，世界。 Emoji: 😀🎉👩‍👩‍👧 Ünïcödé ñ ç 日本語のテキスト 🇯🇵 — done."

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current température in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    "think_in_history": [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "<think>\nAny number works.\n</think>\n\nSeven."},
        {"role": "user", "content": "Why?"},
    ],
    "think_in_last_turn": [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "<think>\nAny number works.\n</think>\n\nSeven."},
    ],
    "reasoning_content_field": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets me."},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools when helpful."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": '{"temperature": 21, "unit": "celsius"}'},
        {"role": "tool", "content": '{"note": "sunny"}'},
    ],
}


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One trained tokenizer directory per arch (training takes a few milliseconds)."""
    dirs = {}
    for arch in ARCHES:
        out = tmp_path_factory.mktemp(f"tok_{arch}")
        train_tokenizer([bundled_corpus()], VOCAB_SIZE, out, arch=arch)
        dirs[arch] = out
    return dirs


@pytest.fixture(scope="module")
def toks(tok_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {arch: Tokenizer.from_dir(path) for arch, path in tok_dirs.items()}


@pytest.fixture(scope="module")
def hf_toks(tok_dirs: dict[str, Path]) -> dict:
    """The same directories loaded by transformers (imported here only: the engine never imports it)."""
    transformers = pytest.importorskip("transformers")
    return {arch: transformers.AutoTokenizer.from_pretrained(str(path)) for arch, path in tok_dirs.items()}



def test_bundled_corpus_is_short_prose() -> None:
    text = bundled_corpus()
    assert 6_000 <= len(text.encode("utf-8")) <= 12_000
    assert "Alice" in text and "\n\n" in text


@pytest.mark.parametrize("arch", ARCHES)
def test_trained_layout(toks: dict[str, Tokenizer], tok_dirs: dict[str, Path], arch: str) -> None:
    tok = toks[arch]
    added = qwen_added_tokens(arch)
    assert tok.vocab_size == VOCAB_SIZE
    assert len(added) == (26 if arch == "qwen3" else 22)
    first = VOCAB_SIZE - len(added)
    # Added tokens sit right after the learned vocabulary, in Qwen's order.
    assert [tok.id_to_token(first + i) for i in range(len(added))] == QWEN_SPECIAL_TOKENS[: len(added)]
    assert tok.token_to_id("<|endoftext|>") == first == tok.pad_token_id
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>") == first + 2
    assert tok.bos_token_id is None
    assert (tok.token_to_id("<think>") is not None) == (arch == "qwen3")
    config = json.loads((tok_dirs[arch] / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer" and config["add_bos_token"] is False
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] is None
    assert ("enable_thinking" in config["chat_template"]) == (arch == "qwen3")
    assert all((tok_dirs[arch] / name).is_file() for name in ("tokenizer.json", "vocab.json", "merges.txt"))


def test_think_tokens_are_not_special(toks: dict[str, Tokenizer]) -> None:
    tok = toks["qwen3"]
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\nok"
    assert tok.decode(ids, skip_special_tokens=False).endswith("ok<|im_end|>")


def test_train_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        train_tokenizer(["abc"], 1024, tmp_path, arch="llama")
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], 100, tmp_path)



@pytest.mark.parametrize("arch", ARCHES)
def test_encode_decode_match_transformers(toks: dict[str, Tokenizer], hf_toks: dict, arch: str) -> None:
    tok, hf = toks[arch], hf_toks[arch]
    assert len(hf) == tok.vocab_size
    assert len(ENCODE_TEXTS[-1]) >= RELEASE_LOCK_CHARS > max(len(text) for text in ENCODE_TEXTS[:-1])
    for text in ENCODE_TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ids == tok.encode(text, add_special_tokens=True) == hf.encode(text), "Qwen adds no BOS/EOS"
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.encode("<|im_end|>") == [tok.eos_token_id]
    assert tok.eos_token_id == hf.eos_token_id and tok.pad_token_id == hf.pad_token_id



def _hf_render(hf, messages, add_generation_prompt, tools, enable_thinking) -> str:
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                  tools=tools, **extra)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
def test_chat_template_matches_transformers(toks: dict[str, Tokenizer], hf_toks: dict, arch: str, name: str,
                                            with_tools: bool) -> None:
    tok, hf = toks[arch], hf_toks[arch]
    messages = CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if with_tools else None
    for add_generation_prompt in (True, False):
        for enable_thinking in (None, True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                           enable_thinking=enable_thinking)
            expected = _hf_render(hf, messages, add_generation_prompt, tools, enable_thinking)
            assert ours == expected, (add_generation_prompt, enable_thinking)


def test_qwen3_template_published_behaviour(toks: dict[str, Tokenizer]) -> None:
    """Spot checks against outputs of the real Qwen3 checkpoints (not just self-consistency with HF)."""
    tok = toks["qwen3"]
    hi = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(hi) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(hi, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    done = tok.apply_chat_template(hi + [{"role": "assistant", "content": "Hello"}], add_generation_prompt=False)
    assert done == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"
    history = tok.apply_chat_template(CONVERSATIONS["think_in_history"])
    assert "Any number works" not in history and "<|im_start|>assistant\nSeven.<|im_end|>" in history
    with_tools = tok.apply_chat_template(hi, tools=[WEATHER_TOOL])
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in with_tools


def test_qwen2_template_default_system_prompt(toks: dict[str, Tokenizer]) -> None:
    out = toks["qwen2"].apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                   "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_template_kwargs_and_special_tokens_reach_template(tok_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tok_dirs["qwen3"], model_dir)
    # {% generation %} (assistant-mask markers in some fine-tuned templates) must render its body unchanged.
    (model_dir / "chat_template.jinja").write_text(
        "{{ eos_token }}|{{ greeting }}|{% generation %}{{ enable_thinking is defined }}{% endgeneration %}")
    tok = Tokenizer.from_dir(model_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], greeting="hey") == "<|im_end|>|hey|False"



def _stream(tok: Tokenizer, ids: list[int], prompt_ids: list[int] = (), skip: bool = True) -> list[str]:
    det = tok.new_detokenizer(prompt_ids, skip_special_tokens=skip)
    deltas = [det.push(i) for i in ids] + [det.flush()]
    assert det.token_ids == ids and det.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("prompt", ["", "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"])
def test_incremental_detokenizer_multibyte(toks: dict[str, Tokenizer], prompt: str) -> None:
    tok = toks["qwen3"]
    ids = tok.encode(MULTIBYTE_TEXT)
    # The test only means something if characters really are split over several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = _stream(tok, ids, tok.encode(prompt))
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE_TEXT
    assert not any("\ufffd" in d for d in deltas), "a partial character was emitted"


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_special_tokens(toks: dict[str, Tokenizer], skip: bool) -> None:
    tok = toks["qwen3"]
    ids = tok.encode("<think>\nhmm 你好\n</think>\n\nAnswer: 😀<|im_end|><|endoftext|>")
    text = "".join(_stream(tok, ids, skip=skip))
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip
    assert "<think>" in text  # not a special token, kept either way


def test_incremental_detokenizer_invalid_and_truncated_bytes(toks: dict[str, Tokenizer]) -> None:
    tok = toks["qwen3"]
    e_acute = tok.encode("é")  # two byte tokens (C3 A9): the corpus is ASCII
    assert len(e_acute) == 2
    lone_continuation = e_acute[1]
    emoji = tok.encode("😀")  # 4 byte tokens
    for ids in ([lone_continuation] + tok.encode("ab"), tok.encode("x") + emoji[:2], emoji[:3] + emoji):
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_incremental_detokenizer_window_stays_small(toks: dict[str, Tokenizer], monkeypatch) -> None:
    """Per-token cost must not grow with the generation: only a few ids are ever re-decoded."""
    tok = toks["qwen3"]
    ids = tok.encode(bundled_corpus()[:3000] + MULTIBYTE_TEXT)
    lengths: list[int] = []
    original = Tokenizer.decode

    def spy(self, token_ids, skip_special_tokens=True):
        lengths.append(len(token_ids))
        return original(self, token_ids, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", spy)
    det = tok.new_detokenizer(tok.encode("prompt " * 50))
    text = "".join(det.push(i) for i in ids) + det.flush()
    monkeypatch.undo()
    assert len(ids) > 500 and text == tok.decode(ids)
    assert max(lengths) <= 12



def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(TokenizerError, match="nope.json"):
        Tokenizer.from_dir(tmp_path, tokenizer_file=tmp_path / "nope.json")


def test_explicit_tokenizer_file_and_config_only_added_tokens(tok_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Added tokens listed only in tokenizer_config.json are appended with their configured ids."""
    src = tok_dirs["qwen3"]
    data = json.loads((src / "tokenizer.json").read_text())
    data["added_tokens"] = []
    (tmp_path / "bare.json").write_text(json.dumps(data))
    shutil.copy(src / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    tok = Tokenizer.from_dir(tmp_path, tokenizer_file=tmp_path / "bare.json")
    ref = Tokenizer.from_dir(src)
    assert tok.vocab_size == ref.vocab_size and tok.eos_token_id == ref.eos_token_id
    text = "<|im_start|>user\n<think>x</think><|im_end|>"
    assert tok.encode(text) == ref.encode(text) and tok.decode(tok.encode(text)) == ref.decode(ref.encode(text))


def test_no_chat_template(tok_dirs: dict[str, Path], tmp_path: Path) -> None:
    shutil.copy(tok_dirs["qwen3"] / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_dir(tmp_path)  # no tokenizer_config.json at all
    assert tok.chat_template is None and tok.eos_token_id is None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_files_win_and_errors_are_reported(tok_dirs: dict[str, Path], tmp_path: Path) -> None:
    shutil.copytree(tok_dirs["qwen3"], tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "json:{{ messages[0].content }}"}))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "a"}]) == "json:a"
    raising = "{% if messages[0].role != 'user' %}{{ raise_exception('Only user roles are supported!') }}{% endif %}ok"
    (tmp_path / "chat_template.jinja").write_text(raising)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "ok"
    with pytest.raises(TokenizerError, match="Only user roles are supported!"):
        tok.apply_chat_template([{"role": "system", "content": "a"}])
    tok.chat_template = "{% if %}"
    with pytest.raises(TokenizerError, match="chat template error"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])
