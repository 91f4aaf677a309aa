"""Qwen3.5 with images (HF's Qwen3_5ForConditionalGeneration: Qwen3-VL's tower without DeepStack, M-RoPE over the
partial-rotary share of each head) against HF transformers, tiny random model, fp32 CPU: logits through the paged
prefill + decode path with two images of different sizes, greedy tokens through the whole engine (orinfer's image
processor included), one image over several prompt chunks (the linear-attention state carried between them), text
prompts batched beside an image prompt, and the published configs' vision fields."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hf_models import VL_IDS, build_hf_qwen3_5, hf_vl_greedy, hf_vl_logits, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.config import ModelConfig
from orinfer.engine.multimodal import expand_placeholders, prepare_images
from orinfer.models.qwen3_vl_vision import VisionConfig
from test_hf_parity import paged_logits

pytest.importorskip("transformers")

REAL = Path(__file__).parent / "data" / "real-qwen"
IMG, VS, VE = VL_IDS["image_token_id"], VL_IDS["vision_start_token_id"], VL_IDS["vision_end_token_id"]
# The tiny tower's patches are 8 pixels (merge 2: a visual token per 16x16 pixels); small bounds keep CPU time low.
PATCH, MIN_PIXELS, MAX_PIXELS = 8, 16 * 16, 64 * 64
STEPS = 16
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
TWO_IMAGES = [5, VS, IMG, VE, 17, 42, VS, IMG, VE, 7]
TEXT_PROMPTS = [[7, 8, 9, 10, 11], [88] * 6 + [3]]


def images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    """Random RGB images of the given (width, height)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def hf_pixels(pil: list[Image.Image]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """HF's own preprocessing (its PIL backend) with the test's patch size and pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                    patch_size=PATCH, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3)
    out = proc(pil, return_tensors="pt")
    return out["pixel_values"], [tuple(int(v) for v in g) for g in out["image_grid_thw"]]


# Two sizes and aspect ratios: 64x32 pixels (8x4 patches, 8 visual tokens) and 32x96 (4x12, 12 tokens).
PICTURES = images([(60, 40), (30, 90)])
PIXELS, GRIDS = hf_pixels(PICTURES)


@pytest.fixture(scope="module", params=["qwen3.5-interval4-untied", "qwen3.5-mixed-tied"])
def model_dir(request, tmp_path_factory):
    """A tiny Qwen3_5ForConditionalGeneration with every parameter random: untied head, three linear-attention layers
    then a full one, a quarter of each head rotary (mrope_section [1, 1, 0]: t and h); or a tied head, layers full /
    linear / full / linear / linear, half of each head rotary ([2, 1, 1]: all three axes)."""
    hf = build_hf_qwen3_5(request.param, vision=True)
    if hf.config.tie_word_embeddings:
        # The tied head is the unit-normal embedding, so logits reach ~60, where fp32 rounding alone (HF's fp32 logits
        # against its own, sixty times smaller ones) exceeds 1e-4. The final norm's scale (1 + w: zero-centred) is cut
        # tenfold, so every logit is compared at 1e-4. HF's float64 model is no exact reference: its norms and delta
        # rule cast to float32 inside.
        with torch.no_grad():
            hf.model.language_model.norm.weight.mul_(0.1).sub_(0.9)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "patch_size": PATCH, "merge_size": 2,
         "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    return hf, path


def engine(path: Path, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=4, progress=False, **settings)


def request(prompt: list[int], pil: list[Image.Image]) -> dict:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"image": pil}}


def test_two_images_logits_match_hf(model_dir):
    """Prefill of a prompt with two images (preprocessed by orinfer, placeholders expanded), then decode steps at
    n + delta: every position's logits within 1e-4 of HF's."""
    hf, path = model_dir
    llm = engine(path)
    cfg = llm.engine.parts.model_config
    ids, mm = prepare_images(TWO_IMAGES, PICTURES, llm.engine.parts.image_processor, cfg)
    assert ids == expand_placeholders(TWO_IMAGES, IMG, [t * h * w // 4 for t, h, w in GRIDS])
    # Positions advance by max(h, w) / 2 over an image of h * w / 4 tokens: the decode offset is negative.
    assert mm.grid_thw == GRIDS == [(1, 4, 8), (1, 12, 4)] and mm.delta < 0
    torch.testing.assert_close(mm.pixel_values, PIXELS, atol=1e-5, rtol=0)
    extra = [11, 200, 14, 88, 7]
    got = paged_logits(llm, ids + extra, len(ids), mm)
    want = hf_vl_logits(hf, ids + extra, PIXELS, GRIDS)
    assert got.shape == want.shape and want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_two_images_greedy_tokens_match_hf(model_dir):
    hf, path = model_dir
    out = engine(path).generate(request(TWO_IMAGES, PICTURES), GREEDY)[0]
    assert out.token_ids == hf_vl_greedy(hf, out.prompt_token_ids, STEPS, PIXELS, GRIDS)
    assert out.metrics.vision_encode_ms is not None and out.metrics.vision_encode_ms > 0


def test_one_image_over_several_chunks_matches_hf(model_dir):
    """Prompt chunks of 5 tokens: the image's 12 visual rows arrive over three steps, each chunk taking its rows of
    the tower's output and continuing the linear-attention state of the one before."""
    hf, path = model_dir
    prompt = [5, 17, 42, VS, IMG, VE, 99, 3]
    llm = engine(path, max_num_batched_tokens=5)
    out = llm.generate(request(prompt, PICTURES[1:]), GREEDY)[0]
    assert out.prompt_token_ids.count(IMG) == 12 > 2 * 5
    assert out.token_ids == hf_vl_greedy(hf, out.prompt_token_ids, STEPS, *hf_pixels(PICTURES[1:]))


def test_text_prompts_batched_with_an_image_prompt(model_dir):
    """Text prompts beside an image prompt in the same steps: each gets HF's tokens (text rows use plain positions;
    decode rows of the image prompt its shifted ones)."""
    hf, path = model_dir
    outs = engine(path).generate([TEXT_PROMPTS[0], request(TWO_IMAGES, PICTURES), TEXT_PROMPTS[1]], GREEDY)
    assert outs[1].token_ids == hf_vl_greedy(hf, outs[1].prompt_token_ids, STEPS, PIXELS, GRIDS)
    for out, prompt in zip((outs[0], outs[2]), TEXT_PROMPTS):
        assert out.token_ids == hf_vl_greedy(hf, prompt, STEPS)
        assert out.metrics.vision_encode_ms is None


def test_preemption_recomputes_the_image_prompt(model_dir):
    """A KV pool too small for all three prompts: the image prompt, admitted last, is preempted (its state slot and
    blocks freed) and recomputed from its first token, tower included; every prompt still gets HF's tokens."""
    hf, path = model_dir
    llm = engine(path, num_kv_blocks=14, max_num_batched_tokens=6)
    outs = llm.generate([*TEXT_PROMPTS, request(TWO_IMAGES, PICTURES)], GREEDY)
    assert outs[-1].metrics.num_preemptions > 0
    assert outs[-1].token_ids == hf_vl_greedy(hf, outs[-1].prompt_token_ids, STEPS, PIXELS, GRIDS)
    assert [o.token_ids for o in outs[:2]] == [hf_vl_greedy(hf, p, STEPS) for p in TEXT_PROMPTS]
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == 14 and len(manager.free_state_slots) == manager.num_state_slots


@pytest.mark.slow  # the whole model through Triton's CPU interpreter (30-80 s); CI's slow tier and the GPU run it
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="no CUDA and no TRITON_INTERPRET")
def test_triton_ops_give_hf_tokens(model_dir):
    """The triton op table (Triton's CPU interpreter without a GPU): the partial-rotary QK-norm kernel reads the
    per-token M-RoPE table (rotary_dim columns) beside the vision and linear-attention kernels."""
    from orinfer.args import EngineArgs
    from orinfer.engine.llm_engine import EngineParts
    from orinfer.layers.triton_ops import triton_ops
    from orinfer.loader import load_hf_model

    hf, path = model_dir
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig.from_hf(path)
    ops = triton_ops()
    net = load_hf_model(path, ops, torch.float32, torch.float32, device, cfg, progress=False)
    llm = LLM.from_parts(EngineParts(net, cfg, None, {}, device, torch.float32, ops=ops,
                                     image_processor=engine(path).engine.parts.image_processor),
                         EngineArgs(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8))
    pil = PICTURES[:1]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate(request([5, VS, IMG, VE, 17, 42], pil), params)[0]
    assert out.token_ids == hf_vl_greedy(hf, out.prompt_token_ids, 8, *hf_pixels(pil))


@pytest.mark.parametrize("name, depth, width, out", [("Qwen3.5-27B", 27, 1152, 5120), ("Qwen3.5-0.8B", 12, 768, 1024),
                                                      ("Qwen3.8-27B", 27, 1152, 5120)])
def test_published_configs_have_the_vision_fields(name, depth, width, out):
    """Multimodal, HF's placeholder ids, M-RoPE over the 32 rotary frequencies, a tower without DeepStack."""
    cfg = ModelConfig.from_hf(REAL / name)
    assert cfg.is_multimodal and cfg.is_hybrid and cfg.architecture == "Qwen3_5ForConditionalGeneration"
    assert (cfg.image_token_id, cfg.video_token_id) == (248056, 248057)
    assert (cfg.vision_start_token_id, cfg.vision_end_token_id) == (248053, 248054)
    assert cfg.mrope_section == (11, 11, 10) and sum(cfg.mrope_section) == cfg.rotary_dim // 2 == 32
    vision = VisionConfig.from_hf(cfg.vision_config)
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == (depth, width, out)
    assert out == cfg.hidden_size
    assert vision.deepstack_visual_indexes == () and vision.patch_size == 16 and vision.spatial_merge_size == 2


def test_config_defaults_and_errors():
    """HF's Qwen3.5 defaults where a config leaves the ids or the section out; DeepStack taps are ignored (HF's
    Qwen3.5 tower has none); a section wider than the rotary share is refused."""
    from orinfer.errors import ConfigError

    raw = json.loads((REAL / "Qwen3.5-0.8B" / "config.json").read_text())
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        del raw[key]
    del raw["text_config"]["rope_parameters"]["mrope_section"]
    raw["vision_config"]["deepstack_visual_indexes"] = [3, 6]
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.image_token_id, cfg.mrope_section) == (248056, (11, 11, 10))
    assert cfg.vision_config["deepstack_visual_indexes"] == []
    raw["text_config"]["rope_parameters"]["mrope_section"] = [24, 20, 20]   # Qwen3-VL's: 64 frequencies, not 32
    with pytest.raises(ConfigError, match="covers 64"):
        ModelConfig.from_dict(raw)
    del raw["vision_config"]
    with pytest.raises(ConfigError, match="vision_config"):
        ModelConfig.from_dict(raw)
