"""orinfer's Qwen3-VL (torch backend, fp32, CPU) against HF transformers' Qwen3VLForConditionalGeneration built from
tiny random configs: M-RoPE positions and tables, logits through the real paged prefill + decode path with one and
with two images of different sizes, greedy tokens through the whole engine (image preprocessing included), text-only
prompts, batching, preemption, and the triton backend under the CPU interpreter."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from hf_models import VL_CONFIGS, VL_IDS, build_hf_vl_model, hf_vl_greedy, hf_vl_logits
from orinfer import LLM, SamplingParams
from orinfer.config import ModelConfig
from orinfer.engine.multimodal import MultimodalInputs, expand_placeholders
from orinfer.layers.mrope import mrope_cos_sin, mrope_frequency_axes, mrope_positions
from orinfer.layers.ops import TORCH_OPS
from orinfer.loader import load_hf_model
from test_hf_parity import paged_logits

pytest.importorskip("transformers")

IMG, VS, VE = VL_IDS["image_token_id"], VL_IDS["vision_start_token_id"], VL_IDS["vision_end_token_id"]
MIN_PIXELS, MAX_PIXELS = 32 * 32, 96 * 96
GREEDY = dict(temperature=0.0, ignore_eos=True)

ONE_IMAGE = ([5, 17, 42, VS, IMG, VE, 99, 3, 150], [(1, 4, 6)])
TWO_IMAGES = ([5, VS, IMG, VE, 17, 42, VS, IMG, VE, 7, 8], [(1, 4, 6), (1, 8, 2)])


@pytest.fixture(scope="module", params=sorted(VL_CONFIGS))
def vl_pair(request, tmp_path_factory):
    hf = build_hf_vl_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    write_preprocessor_config(path)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, progress=False)
    return hf, llm


def write_preprocessor_config(path) -> None:
    # Small pixel bounds keep the images (and the CPU time) small; the same bounds go to HF's processor.
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "patch_size": 16, "merge_size": 2,
         "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))


def random_inputs(prompt: list[int], grids: list[tuple[int, int, int]], seed: int = 0
                  ) -> tuple[list[int], torch.Tensor, MultimodalInputs]:
    """(expanded ids, pixel_values, the engine's MultimodalInputs) for random patches of the given grids."""
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 1536, generator=torch.Generator().manual_seed(seed))
    ids = expand_placeholders(prompt, IMG, [t * h * w // 4 for t, h, w in grids])
    positions, delta = mrope_positions(ids, IMG, grids, 2)
    index = torch.tensor([i for i, t in enumerate(ids) if t == IMG])
    return ids, pixels, MultimodalInputs(pixels, list(grids), positions, delta, index)


def paged_vl_logits(llm: LLM, ids: list[int], mm: MultimodalInputs | None, extra: list[int]) -> torch.Tensor:
    """Logits of every position: a prefill of `ids` (images through the runner's MultimodalBatch), then one decode
    step per token of `extra`, all through the paged KV cache."""
    return paged_logits(llm, ids + extra, len(ids), mm)


def images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def hf_pixels(pil_images: list[Image.Image]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """HF's own preprocessing of the images (its PIL backend), with the test's pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=16,
                                    merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    out = proc(pil_images, return_tensors="pt")
    return out["pixel_values"], [tuple(int(v) for v in g) for g in out["image_grid_thw"]]


# --- M-RoPE -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt,grids", [
    ([1, 2, 3], []),
    ONE_IMAGE, TWO_IMAGES,
    ([VS, IMG, VE], [(1, 2, 2)]),                          # image first, nothing after but its end marker
    ([4, VS, IMG], [(1, 6, 2)]),                           # image last
    ([VS, IMG, VE, VS, IMG, VE, 9], [(1, 2, 8), (1, 10, 4)]),
])
def test_mrope_positions_match_hf_get_rope_index(prompt, grids):
    hf = build_hf_vl_model("vl-untied")
    ids = expand_placeholders(prompt, IMG, [t * h * w // 4 for t, h, w in grids])
    ours, delta = mrope_positions(ids, IMG, grids, 2)
    inp = torch.tensor([ids])
    expected, hf_delta = hf.model.get_rope_index(inp, (inp == IMG).int(), torch.tensor(grids) if grids else None)
    assert torch.equal(ours, expected[:, 0])
    assert delta == int(hf_delta)


def test_mrope_rows_match_hf_rotary_embedding():
    hf = build_hf_vl_model("vl-untied")
    rotary = hf.model.language_model.rotary_emb
    positions = torch.randint(0, 400, (3, 1, 37), generator=torch.Generator().manual_seed(3))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    from orinfer.kernels.rotary import rope_cos_sin_cache

    table = rope_cos_sin_cache(16, 512, 10000.0)
    rows = mrope_cos_sin(table, positions[:, 0], mrope_frequency_axes(16, (3, 3, 2)))
    assert torch.equal(rows[:, :8], cos[0, :, :8]) and torch.equal(rows[:, 8:], sin[0, :, :8])


def test_text_positions_are_plain_rope():
    positions, delta = mrope_positions(list(range(10)), IMG, [], 2)
    assert delta == 0 and torch.equal(positions, torch.arange(10).expand(3, 10))


# --- logits and tokens against HF ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [ONE_IMAGE, TWO_IMAGES], ids=["one-image", "two-images"])
def test_logits_match_hf(vl_pair, case):
    hf, llm = vl_pair
    ids, pixels, mm = random_inputs(*case)
    extra = [11, 200, 14, 88, 7]  # decode steps after the image prompt: positions n + delta on every axis
    expected = hf_vl_logits(hf, ids + extra, pixels, case[1])
    got = paged_vl_logits(llm, ids, mm, extra)
    assert got.shape == expected.shape
    assert expected.abs().max() > 1.0  # logits of a useful size, so the tolerance below means something
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_text_only_logits_match_hf(vl_pair):
    hf, llm = vl_pair
    ids = [5, 17, 42, 99, 3, 150, 7, 8, 61]
    expected = hf_vl_logits(hf, ids + [11, 200, 14])
    torch.testing.assert_close(paged_vl_logits(llm, ids, None, [11, 200, 14]), expected, atol=1e-4, rtol=0)


def test_greedy_32_tokens_match_hf_with_real_images(vl_pair):
    """The whole path: PIL images -> orinfer's preprocessing -> engine (placeholder expansion, tower, M-RoPE,
    DeepStack, paged decode) against HF's preprocessing + model, 32 greedy tokens."""
    hf, llm = vl_pair
    pil = images([(90, 60), (40, 130)])
    prompt = [5, VS, IMG, VE, 17, 42, VS, IMG, VE, 7]
    out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": pil}},
                       SamplingParams(max_tokens=32, **GREEDY))[0]
    pixels, grids = hf_pixels(pil)
    ids = expand_placeholders(prompt, IMG, [t * h * w // 4 for t, h, w in grids])
    assert out.prompt_token_ids == ids
    assert out.token_ids == hf_vl_greedy(hf, ids, 32, pixels, grids)
    assert out.metrics.vision_encode_ms is not None and out.metrics.vision_encode_ms > 0


def test_text_only_greedy_matches_hf(vl_pair):
    hf, llm = vl_pair
    prompt = [5, 17, 42, 99, 3, 150, 7, 8, 61]
    out = llm.generate([prompt], SamplingParams(max_tokens=32, **GREEDY))[0]
    assert out.token_ids == hf_vl_greedy(hf, prompt, 32)
    assert out.metrics.vision_encode_ms is None


def test_mixed_batch_and_preemption_keep_tokens(vl_pair, tmp_path):
    """An image prompt batched with text prompts gives the tokens it gets alone; so does a run whose KV cache is too
    small for all of them (preemption: the image prompt is recomputed, tower included)."""
    hf, llm = vl_pair
    pil = images([(70, 50)], seed=1)
    vl_prompt = {"prompt_token_ids": [5, VS, IMG, VE, 17, 42], "multi_modal_data": {"image": pil}}
    text_prompts = [[7, 8, 9, 10], [88] * 5]
    params = SamplingParams(max_tokens=24, **GREEDY)
    alone = [llm.generate(p, params)[0].token_ids for p in [vl_prompt] + text_prompts]
    together = [o.token_ids for o in llm.generate([vl_prompt] + text_prompts, params)]
    assert together == alone
    # The same weights in a model of its own (a model's attention layers hold one engine's KV pool), with a KV cache
    # of 14 blocks of 4 tokens: three sequences cannot all fit.
    path = tmp_path / "vl"
    hf.save_pretrained(path, safe_serialization=True)
    model = load_hf_model(path, TORCH_OPS, torch.float32, torch.float32, torch.device("cpu"), ModelConfig.from_hf(path),
                          progress=False)
    small = LLM.from_parts(dataclasses.replace(llm.engine.parts, model=model),
                           llm.engine.config.replace(num_kv_blocks=14, block_size=4))
    # The most recently admitted sequence is preempted first: the image prompt goes last.
    outs = small.generate(text_prompts + [vl_prompt], params)
    assert [o.token_ids for o in outs] == alone[1:] + alone[:1]
    assert outs[-1].metrics.num_preemptions > 0


def test_chunks_and_prefix_cache_keep_two_same_size_images_apart(vl_pair, tmp_path):
    """Two prompts alike but for their image (same size: same placeholder tokens), with prompt chunks of 5 tokens
    (boundaries inside the images) and prefix caching: each gets HF's tokens for its own image, the second shares
    only the blocks before its image, and a repeat of the first hits up to its last token."""
    hf, llm = vl_pair
    path = tmp_path / "vl"
    hf.save_pretrained(path, safe_serialization=True)
    write_preprocessor_config(path)
    chunked = LLM(path, dtype="float32", device="cpu", block_size=4, progress=False, max_num_batched_tokens=5)
    prompt = [5, 17, 42, 99, 3, VS, IMG, VE, 7]
    pil = images([(64, 48), (64, 48)], seed=3)
    outs = []
    for image in (pil[0], pil[1], pil[0]):
        outs.append(chunked.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": [image]}},
                                     SamplingParams(max_tokens=12, logprobs=3, **GREEDY))[0])
    for out, image in zip(outs, (pil[0], pil[1], pil[0])):
        pixels, grids = hf_pixels([image])
        assert out.token_ids == hf_vl_greedy(hf, out.prompt_token_ids, 12, pixels, grids)
    # The first token's runner-up log-probabilities read the whole prompt: they tell the images apart (the tiny
    # model's greedy tokens may not), and the repeat, served from the cache, reproduces them.
    first = [[logprob for _, logprob in o.logprobs[0].top[1:]] for o in outs]
    assert first[0] != pytest.approx(first[1], abs=1e-3) and first[2] == pytest.approx(first[0], abs=1e-5)
    assert [o.num_cached_tokens for o in outs] == [0, 4, 4 * ((len(outs[0].prompt_token_ids) - 1) // 4)]


@pytest.mark.slow  # the whole model through Triton's CPU interpreter (30-80 s); CI's slow tier and the GPU run it
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="no CUDA and no TRITON_INTERPRET")
def test_triton_backend_greedy_matches_torch(vl_pair, tmp_path):
    """The triton op table (vision kernels included; Triton's CPU interpreter without a GPU, CUDA with graphs on
    one) gives the torch backend's greedy tokens for an image prompt."""
    from orinfer.engine.llm_engine import EngineParts
    from orinfer.layers.triton_ops import triton_ops

    hf, llm = vl_pair
    path = tmp_path / "vl"
    hf.save_pretrained(path, safe_serialization=True)
    cfg = ModelConfig.from_hf(path)
    # Under the interpreter the kernels run on CPU tensors; on a GPU machine on CUDA, with CUDA-graph decode.
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ops = triton_ops()
    model = load_hf_model(path, ops, torch.float32, torch.float32, dev, cfg, progress=False)
    parts = llm.engine.parts
    tri = LLM.from_parts(EngineParts(model, cfg, None, {}, dev, torch.float32, ops=ops,
                                     image_processor=parts.image_processor), llm.engine.config)
    prompt = {"prompt_token_ids": [5, VS, IMG, VE, 17], "multi_modal_data": {"image": images([(64, 64)], seed=2)}}
    params = SamplingParams(max_tokens=8, **GREEDY)
    assert tri.generate(prompt, params)[0].token_ids == llm.generate(prompt, params)[0].token_ids


# --- checkpoints and configs --------------------------------------------------------------------------------------

def _legacy_name(name: str) -> str:
    """transformers < 4.57 / Qwen2-VL layout: decoder under "model.", tower under "visual."."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return "visual." + name[len("model.visual."):]
    return name


def test_legacy_checkpoint_layout_loads_the_same_weights(vl_pair, tmp_path):
    from safetensors.torch import save_file


    hf, llm = vl_pair
    hf.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "model.safetensors").unlink()
    save_file({_legacy_name(n): t.detach().clone().contiguous() for n, t in hf.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    model = load_hf_model(tmp_path, TORCH_OPS, torch.float32, torch.float32, torch.device("cpu"),
                          ModelConfig.from_hf(tmp_path), progress=False)
    ours = dict(llm.engine.runner.model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, ours[name]), name


def test_missing_vision_tensor_is_named(vl_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    from orinfer.errors import WeightsError

    hf, _ = vl_pair
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.visual.merger.linear_fc2.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="merger.linear_fc2.weight"):
        LLM(tmp_path, dtype="float32", device="cpu", progress=False)


def test_hf_state_dict_round_trips(vl_pair):
    _, llm = vl_pair
    model = llm.engine.runner.model
    names = {name for name, _ in model.hf_state_dict()}
    assert "model.visual.patch_embed.proj.weight" in names
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in names
    assert all(n.startswith(("model.language_model.", "model.visual.", "lm_head.")) for n in names)


def test_vl_config_parsing():
    from orinfer.config import ModelConfig, preset
    from orinfer.errors import ConfigError

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rope_theta=5_000_000,
                rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True})
    raw = {"architectures": ["Qwen3VLForConditionalGeneration"], "text_config": text, "vision_config": {"depth": 1},
           "image_token_id": 7, "tie_word_embeddings": True, "dtype": "bfloat16"}
    cfg = ModelConfig.from_dict(raw)  # transformers 4.57's layout: rope_scaling + a top-level rope_theta
    assert cfg.mrope_section == (4, 2, 2) and cfg.rope_theta == 5_000_000 and cfg.image_token_id == 7
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.is_multimodal and cfg.torch_dtype == "bfloat16"
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg
    for broken, match in [({**raw, "vision_config": None}, "vision_config"),
                          ({**raw, "text_config": {**text, "rope_scaling": {"mrope_section": [8, 8, 8]}}}, "covers"),
                          ({k: v for k, v in raw.items() if k != "text_config"}, "text_config")]:
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_dict(broken)
    big = preset("qwen3-vl-8b")
    assert (big.hidden_size, big.num_hidden_layers, big.mrope_section) == (4096, 36, (24, 20, 20))
    assert ModelConfig.from_dict(big.to_hf_dict()) == big


def test_gpu_memory_probe_encodes_a_large_image(vl_pair, monkeypatch):
    """The runner's GPU memory probe calls warmup_images (skipped where attention materialises its scores: the torch
    backend); with tiled attention it must run the tower."""
    _, llm = vl_pair
    model = llm.engine.runner.model
    calls, encode = [], model.encode_images
    monkeypatch.setattr(model, "encode_images", lambda pixels, grids: (calls.append(grids), encode(pixels, grids)))
    model.warmup_images(300)
    assert calls == []  # torch backend: no probe
    monkeypatch.setattr(model.visual, "ops", dataclasses.replace(model.visual.ops, materializes_attention=False))
    with torch.inference_mode():
        model.warmup_images(300)
    assert calls == [[(1, 16, 16)]]
