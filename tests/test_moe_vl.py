"""Vision-language MoE checkpoints against HF transformers' own classes, tiny random models, fp32 CPU, torch backend:
Qwen3-VL-MoE (Qwen3-VL's tower with DeepStack, a decoder with a dense layer among sparse ones) and Qwen3.5-MoE's
ConditionalGeneration (Qwen3.5's tower, hybrid decoder, experts and a shared expert): logits with images through the
paged path, greedy tokens with real images through the whole engine, an image over several prompt chunks, text
prompts batched beside an image prompt, and the published Qwen3-VL-MoE checkpoint layout (transposed fused experts)."""

from __future__ import annotations

import json

import pytest
import torch

import test_qwen3_5_vl as vl35
import test_vl_model as vl3
from hf_models import (VL_IDS, build_hf_qwen3_5_moe, build_hf_vl_moe, hf_vl_greedy, hf_vl_logits, rewrite_checkpoint,
                       save_hf_model)
from orinfer import SamplingParams
from orinfer.engine.multimodal import prepare_images
from test_hf_parity import paged_logits

pytest.importorskip("transformers")

IMG, VS, VE = VL_IDS["image_token_id"], VL_IDS["vision_start_token_id"], VL_IDS["vision_end_token_id"]
STEPS = 16
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
TEXT = [7, 8, 9, 10, 11]


engine = vl35.engine


def request(prompt: list[int], pil: list) -> dict:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"image": pil}}


# --- Qwen3-VL-MoE -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vl_moe(tmp_path_factory):
    hf = build_hf_vl_moe()
    path = tmp_path_factory.mktemp("vl-moe")
    hf.save_pretrained(path, safe_serialization=True)   # transformers 5.17 writes the experts fused, [E, 2I, H]
    vl3.write_preprocessor_config(path)
    return hf, path


def test_vl_moe_logits_with_an_image_match_hf(vl_moe):
    """An image prompt (DeepStack features added after the sparse layers' MLP), then decode steps."""
    hf, path = vl_moe
    ids, pixels, mm = vl3.random_inputs(*vl3.ONE_IMAGE)
    extra = [11, 200, 14, 88]
    want = hf_vl_logits(hf, ids + extra, pixels, vl3.ONE_IMAGE[1])
    assert want.abs().max() > 1.0
    torch.testing.assert_close(paged_logits(engine(path), ids + extra, len(ids), mm), want, atol=1e-4, rtol=0)


def test_vl_moe_greedy_with_images_beside_a_text_prompt(vl_moe):
    """PIL images through orinfer's preprocessing and the engine, batched with a text prompt: HF's tokens for both."""
    hf, path = vl_moe
    pil = vl3.images([(90, 60), (40, 130)])
    prompt = [5, VS, IMG, VE, 17, 42, VS, IMG, VE, 7]
    image_out, text_out = engine(path).generate([request(prompt, pil), TEXT], GREEDY)
    assert image_out.token_ids == hf_vl_greedy(hf, image_out.prompt_token_ids, STEPS, *vl3.hf_pixels(pil))
    assert text_out.token_ids == hf_vl_greedy(hf, TEXT, STEPS)


def test_the_published_transposed_expert_layout_loads(vl_moe, tmp_path):
    """Qwen3-VL-30B-A3B's files store experts.gate_up_proj as [E, H, 2I] and down_proj as [E, I, H]."""
    _, path = vl_moe
    published = tmp_path / "published"

    def transpose(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: t.transpose(1, 2).contiguous() if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
                else t for name, t in tensors.items()}

    rewrite_checkpoint(path, published, transpose)
    ids, _, mm = vl3.random_inputs(*vl3.ONE_IMAGE)
    torch.testing.assert_close(paged_logits(engine(published), ids, len(ids), mm),
                               paged_logits(engine(path), ids, len(ids), mm), atol=0, rtol=0)


# --- Qwen3.5-MoE with images -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_5_moe_vl(tmp_path_factory):
    hf = build_hf_qwen3_5_moe("qwen3.5moe-e6-top2", vision=True)
    # The gated RMSNorm after the delta rule scales each value head to unit RMS: a head whose output is small (RMS
    # ~0.008 at an image token here) multiplies the delta rule's last-bit fp32 differences (HF's chunked form against
    # orinfer's: 1e-7) a hundredfold, and the layers after add to it, to ~2e-4 on logits of ~8 (HF's dense
    # Qwen3.5 with seed 1 shows the same, 5e-4). As test_qwen3_5_vl.py does for its tied model, the final norm's scale
    # (1 + w) is cut tenfold so that every logit is compared at 1e-4; greedy choices are unchanged.
    with torch.no_grad():
        hf.model.language_model.norm.weight.mul_(0.1).sub_(0.9)
    path = save_hf_model(hf, tmp_path_factory.mktemp("qwen3_5_moe_vl"))
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": vl35.MIN_PIXELS, "longest_edge": vl35.MAX_PIXELS}, "patch_size": vl35.PATCH,
         "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    return hf, path


def test_qwen3_5_moe_two_images_logits_match_hf(qwen3_5_moe_vl):
    hf, path = qwen3_5_moe_vl
    llm = engine(path)
    ids, mm = prepare_images(vl35.TWO_IMAGES, vl35.PICTURES, llm.engine.parts.image_processor,
                             llm.engine.parts.model_config)
    extra = [11, 200, 14, 88, 7]
    want = hf_vl_logits(hf, ids + extra, vl35.PIXELS, vl35.GRIDS)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(paged_logits(llm, ids + extra, len(ids), mm), want, atol=1e-4, rtol=0)


def test_qwen3_5_moe_an_image_over_several_chunks(qwen3_5_moe_vl):
    """Prompt chunks of 5 tokens: the image's 12 visual rows arrive over three steps, beside a text prompt's rows."""
    hf, path = qwen3_5_moe_vl
    prompt = [5, 17, 42, VS, IMG, VE, 99, 3]
    image_out, text_out = engine(path, max_num_batched_tokens=5).generate(
        [request(prompt, vl35.PICTURES[1:]), TEXT], GREEDY)
    assert image_out.prompt_token_ids.count(IMG) == 12
    assert image_out.token_ids == hf_vl_greedy(hf, image_out.prompt_token_ids, STEPS,
                                               *vl35.hf_pixels(vl35.PICTURES[1:]))
    assert text_out.token_ids == hf_vl_greedy(hf, TEXT, STEPS)
