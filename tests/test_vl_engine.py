"""Qwen3-VL through the public API and the CLI, on `make-tiny --arch qwen3-vl` (the trained tiny Qwen3 language
model behind a random vision tower): chat content parts, vLLM-style multi_modal_data, request errors, the chat
template, loading in HF transformers, and `orinfer generate --image`."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from orinfer import LLM, SamplingParams
from orinfer.cli import main
from orinfer.errors import RequestError
from orinfer.tokenizer import Tokenizer, builtin_chat_template

GREEDY = dict(temperature=0.0)
MARK = "<|vision_start|><|image_pad|><|vision_end|>"
VL_TIMING = re.compile(r"\[prompt \d+ tokens, generated \d+ tokens, vision encode [\d.]+ ms, prefill [\d.]+ tok/s, "
                       r"decode [\d.]+ tok/s, TTFT [\d.]+ ms, finish: \w+\]")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory, tiny_dir):
    """`make-tiny --arch qwen3-vl` with 160 training steps. Its language model is the one `tiny_dir` already trained
    with the same recipe, taken from there instead of trained again: the files are the same, bit for bit
    (test_make_tiny_vl_reuses_the_trained_text_model_bit_for_bit)."""
    from orinfer.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3-vl"), arch="qwen3-vl", train_steps=160, progress=False,
                     text_model=tiny_dir)


@pytest.fixture(scope="module")
def vl_llm(vl_dir):
    return LLM(vl_dir, dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """Two PNG files of different sizes and aspect ratios."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate([(90, 120), (200, 60)]):
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


# --- the API ------------------------------------------------------------------------------------------------------

def test_chat_with_content_parts(vl_llm, pictures):
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(pictures[0])}},
        {"type": "text", "text": "Compare with"},
        {"type": "image", "image": Image.open(pictures[1])},
        {"type": "image_url", "image_url": {"url": data_url(pictures[0])}},
    ]}]
    assert vl_llm.render_chat(messages) == (f"<|im_start|>user\n{MARK}Compare with{MARK}{MARK}<|im_end|>\n"
                                            "<|im_start|>assistant\n")
    out = vl_llm.chat(messages, SamplingParams(max_tokens=10, **GREEDY))[0]
    assert len(out.token_ids) == 10 and out.text
    pad = vl_llm.tokenizer.token_to_id("<|image_pad|>")
    # 120x90 (w x h) -> 128x96 pixels = 8x6 patches = 12 tokens (twice: path and data URL); 60x200 -> 64x192
    # pixels = 4x12 patches = 12 tokens.
    assert out.prompt_token_ids.count(pad) == 3 * 12
    assert out.metrics.vision_encode_ms > 0 and out.metrics.prefill_tok_s > 0


def test_generate_with_multi_modal_data_equals_chat(vl_llm, pictures):
    messages = [{"role": "user", "content": [{"type": "image", "image": str(pictures[1])},
                                             {"type": "text", "text": "Describe this image."}]}]
    params = SamplingParams(max_tokens=12, **GREEDY)
    chat = vl_llm.chat(messages, params)[0]
    prompt = f"<|im_start|>user\n{MARK}Describe this image.<|im_end|>\n<|im_start|>assistant\n"
    gen = vl_llm.generate({"prompt": prompt, "multi_modal_data": {"image": pictures[1]}}, params)[0]
    assert gen.token_ids == chat.token_ids and gen.prompt_token_ids == chat.prompt_token_ids
    streamed = "".join(vl_llm.stream({"prompt": prompt, "multi_modal_data": {"image": [pictures[1]]}}, params))
    assert streamed == gen.text
    # A smaller max_pixels makes fewer visual tokens (and a different prompt).
    small = vl_llm.generate({"prompt": prompt, "multi_modal_data": {"image": pictures[1]},
                             "mm_processor_kwargs": {"max_pixels": 32 * 64}}, params)[0]
    assert len(small.prompt_token_ids) < len(gen.prompt_token_ids)


def test_text_only_prompts_behave_exactly_like_qwen3(vl_llm, tiny_llm):
    """Same language weights (make-tiny trains the same model for qwen3 and qwen3-vl): same tokens, no vision work."""
    prompts = ["Alice was beginning to get very", "The rabbit-hole went", "Down, down, down."]
    params = SamplingParams(max_tokens=24, **GREEDY)
    ours = vl_llm.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in tiny_llm.generate(prompts, params)]
    assert all(o.metrics.vision_encode_ms is None for o in ours)
    assert ours[0].text.startswith(" tired of sitting")


@pytest.mark.parametrize("prompt,count", [(f"<|im_start|>user\n{MARK}{MARK}hi", 1), ("no placeholder", 1),
                                          (f"{MARK} one", 2), (f"{MARK} unexpected", 0)])
def test_placeholder_and_image_count_mismatch(vl_llm, pictures, prompt, count):
    request = {"prompt": prompt, "multi_modal_data": {"image": [pictures[0]] * count}} if count else prompt
    with pytest.raises(RequestError, match=r"image placeholder\(s\)"):
        vl_llm.generate(request, SamplingParams(max_tokens=2))
    assert not vl_llm.engine.has_unfinished()


def test_prompt_too_long_counts_image_tokens(vl_dir, pictures):
    llm = LLM(vl_dir, dtype="float32", device="cpu", progress=False, max_model_len=24)
    prompt = f"<|im_start|>user\n{MARK}Hi<|im_end|>\n"  # 10 text tokens or so, + 12 image tokens
    text_len = len(llm.tokenizer.encode(prompt))
    assert text_len < 24 - 1
    with pytest.raises(RequestError, match="tokens"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": pictures[0]}}, SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("part,match", [
    ({"type": "image_url", "image_url": {"url": "/no/such/image.png"}}, "image"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "network"),
    ({"type": "video", "video": "clip.mp4"}, "not supported"),
    ({"type": "audio"}, "unknown content part"),
    ({"type": "image"}, "needs an 'image'"),
])
def test_bad_image_inputs_are_request_errors(vl_llm, part, match):
    with pytest.raises(RequestError, match=match):
        vl_llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}],
                    SamplingParams(max_tokens=2))
    assert not vl_llm.engine.has_unfinished()


def test_text_model_rejects_images_but_takes_text_parts(tiny_llm, pictures):
    with pytest.raises(RequestError, match="takes no images"):
        tiny_llm.chat([{"role": "user", "content": [{"type": "image", "image": str(pictures[0])}]}])
    with pytest.raises(RequestError, match="takes no images"):
        tiny_llm.generate({"prompt": "hi", "multi_modal_data": {"image": str(pictures[0])}})
    parts = tiny_llm.chat([{"role": "user", "content": [{"type": "text", "text": "Who is "},
                                                        {"type": "text", "text": "Alice?"}]}],
                          SamplingParams(max_tokens=4, **GREEDY))[0]
    plain = tiny_llm.chat([{"role": "user", "content": "Who is Alice?"}], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert parts.token_ids == plain.token_ids


# --- the chat template --------------------------------------------------------------------------------------------

TEXT_CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "and?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}},
         {"type": "function", "function": {"name": "get", "arguments": '{"city": "Rome"}'}}]},
     {"role": "tool", "content": "12C"}, {"role": "tool", "content": "20C"},
     {"role": "assistant", "content": "Paris 12C, Rome 20C."}, {"role": "user", "content": "thanks"}],
]
TOOLS = [{"type": "function", "function": {"name": "get", "description": "weather",
                                           "parameters": {"type": "object", "properties": {"city": {}}}}}]


@pytest.mark.parametrize("messages", TEXT_CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_vl_template_renders_text_like_qwen3(vl_llm, messages, tools):
    """Without images or thinking, Qwen3-VL's template and Qwen3's published one render the same text, except that
    Qwen3-VL leaves out a system message that is not the first (Qwen3 renders it in place)."""
    qwen3 = Tokenizer(vl_llm.tokenizer._backend, {}, {"default": builtin_chat_template("qwen3")})
    for system in ([], [{"role": "system", "content": "You are a bot."}]):
        conversation = system + messages
        without_later_systems = [m for i, m in enumerate(conversation) if i == 0 or m["role"] != "system"]
        assert vl_llm.render_chat(conversation, tools=tools) == qwen3.apply_chat_template(without_later_systems,
                                                                                          tools=tools)


def test_vl_template_images_in_every_role_and_vision_ids(vl_llm):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Look."}]},
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "and "}, {"image_url": {"url": "b.png"}},
                                     {"type": "video", "video": "c.mp4"}]},
    ]
    expected = ("<|im_start|>system\nLook.<|im_end|>\n<|im_start|>user\n{p1}" + MARK + "this?<|im_end|>\n"
                "<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nand {p2}" + MARK +
                "{v1}<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    assert vl_llm.render_chat(messages) == expected.format(p1="", p2="", v1="")
    assert vl_llm.render_chat(messages, add_vision_id=True) == expected.format(
        p1="Picture 1: ", p2="Picture 2: ", v1="Video 1: ")


def test_builtin_template_used_when_the_model_has_none(vl_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(vl_dir, bare)
    (bare / "chat_template.jinja").unlink()
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(bare, dtype="float32", device="cpu", progress=False)
    assert llm.tokenizer.chat_template == builtin_chat_template("qwen3_vl")


# --- HF transformers and the CLI ----------------------------------------------------------------------------------

def test_make_tiny_vl_loads_in_hf_and_generates_the_same(vl_dir, vl_llm, pictures):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(vl_dir)
    pre = json.loads((vl_dir / "preprocessor_config.json").read_text())
    proc = Qwen2VLImageProcessorPil(**{k: v for k, v in pre.items() if k not in ("image_processor_type",
                                                                                "processor_class")})
    messages = [{"role": "user", "content": [{"type": "image", "image": str(pictures[0])},
                                             {"type": "text", "text": "Describe"},
                                             {"type": "image", "image": str(pictures[1])}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == vl_llm.render_chat(messages)
    pixels = proc([Image.open(p).convert("RGB") for p in pictures], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0] + "".join("<|image_pad|>" * int(g.prod() // 4) + p for g, p in zip(grid, pieces[1:]))
    ids = torch.tensor([tok(expanded, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   pixel_values=pixels["pixel_values"], image_grid_thw=grid,
                                   mm_token_type_ids=(ids == model.config.image_token_id).int(),
                                   max_new_tokens=16, do_sample=False)
    ours = vl_llm.chat(messages, SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY))[0]
    assert ours.prompt_token_ids == ids[0].tolist()
    assert ours.token_ids == generated[0, ids.shape[1]:].tolist()


def test_cli_generate_with_images(vl_dir, pictures, capsys):
    rc = main(["generate", "-m", str(vl_dir), "--device", "cpu", "--dtype", "float32", "--image", str(pictures[0]),
               "--image", str(pictures[1]), "-p", "Describe these images", "--max-tokens", "8", "--temperature", "0",
               "--max-pixels", "8192"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip()
    assert VL_TIMING.search(err), err


def test_cli_image_errors_are_clean(vl_dir, tmp_path, capsys):
    rc = main(["generate", "-m", str(vl_dir), "--device", "cpu", "--image", str(tmp_path / "missing.png"), "-p", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: image file" in err and "not found" in err and "Traceback" not in err
    assert main(["generate", "-m", str(vl_dir), "--device", "cpu", "--image", "x.png", "-p", "x",
                 "--max-pixels", "10"]) == 2
    assert "max_pixels" in capsys.readouterr().err


def _files(model_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


def test_make_tiny_vl_reuses_the_trained_text_model_bit_for_bit(tmp_path):
    """`make_tiny(..., text_model=DIR)` (how `vl_dir` is made) writes the very files that training from scratch
    writes; a text model of another recipe is refused."""
    from orinfer.tiny import make_tiny

    text = make_tiny(tmp_path / "text", arch="qwen3", train_steps=3, progress=False)
    scratch = make_tiny(tmp_path / "scratch", arch="qwen3-vl", train_steps=3, progress=False)
    reused = make_tiny(tmp_path / "reused", arch="qwen3-vl", train_steps=3, progress=False, text_model=text)
    assert _files(reused) == _files(scratch)
    assert "model.safetensors" in _files(scratch)
    for other in (dict(train_steps=4), dict(train_steps=3, seed=1)):
        with pytest.raises(ValueError, match="not a make-tiny output made with"):
            make_tiny(tmp_path / "other", arch="qwen3-vl", progress=False, text_model=text, **other)
    qwen2 = make_tiny(tmp_path / "qwen2", arch="qwen2", train_steps=3, progress=False)
    for wrong in (qwen2, scratch, tmp_path):   # another arch, a VL model, no model at all
        with pytest.raises(ValueError, match="not a make-tiny output made with"):
            make_tiny(tmp_path / "other", arch="qwen3-vl", train_steps=3, progress=False, text_model=wrong)


def test_cli_make_tiny_qwen3_vl(tmp_path, capsys):
    assert main(["make-tiny", "--arch", "qwen3-vl", "--train-steps", "0", str(tmp_path / "m")]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert {"text_config", "vision_config", "image_token_id"} <= set(config)
    assert (tmp_path / "m" / "preprocessor_config.json").is_file()
    assert "qwen3-vl" in capsys.readouterr().out


def _png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_image_bytes_are_accepted(vl_llm):
    out = vl_llm.generate({"prompt": f"{MARK}red?", "multi_modal_data": {"image": _png_bytes()}},
                          SamplingParams(max_tokens=3, **GREEDY))[0]
    assert len(out.token_ids) == 3
