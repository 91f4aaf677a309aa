"""`orinfer make-tiny --arch qwen3-vl`: the trained tiny Qwen3 language model behind a small random vision tower,
written as a Hugging Face Qwen3-VL directory (config.json with text_config / vision_config, safetensors in HF's
"model.language_model.*" / "model.visual.*" layout, tokenizer with the vision special tokens,
preprocessor_config.json, chat_template.jinja). Both orinfer and HF transformers load it.

The tower is random (no image data to train on), so answers about images are noise; what the model exercises is
the whole path: image loading and preprocessing, the tower, placeholder expansion, M-RoPE, DeepStack, decoding.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from orinfer.config import VL_ARCHITECTURE, ModelConfig
from orinfer.layers.ops import TORCH_OPS
from orinfer.tokenizer import builtin_chat_template

log = logging.getLogger(__name__)

# Small, but every feature of the real tower: two blocks, a DeepStack tap after each, 2x2 merging, an 8x8 learned
# position grid that images of other sizes interpolate. out_hidden_size must equal the decoder's hidden size.
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                   deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh", model_type="qwen3_vl_vision")
# Images become 32x32 .. 128x128 pixels: 1 to 16 visual tokens, cheap on a CPU.
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 32 * 32, 128 * 128


def vl_config(text: ModelConfig, tokenizer) -> ModelConfig:
    """The tiny text config turned into a Qwen3-VL one (ids from the tokenizer's vision tokens)."""
    half = text.head_dim // 2
    # Qwen3-VL-8B gives t/h/w 24/20/20 of 64 frequencies; the same proportions here.
    h = w = round(half * 20 / 64)
    return dataclasses.replace(
        text, architecture=VL_ARCHITECTURE, qk_norm=True, mrope_section=(half - h - w, h, w),
        vision_config=dict(TINY_VISION, out_hidden_size=text.hidden_size),
        image_token_id=tokenizer.token_to_id("<|image_pad|>"), video_token_id=tokenizer.token_to_id("<|video_pad|>"),
        vision_start_token_id=tokenizer.token_to_id("<|vision_start|>"),
        vision_end_token_id=tokenizer.token_to_id("<|vision_end|>"))


def random_vision_tower(cfg: ModelConfig, seed: int) -> nn.Module:
    """The tower with seeded random weights at scales that keep activations O(1) (norms near 1, small biases)."""
    from orinfer.models.qwen3_vl_vision import Qwen3VLVisionTower, VisionConfig

    tower = Qwen3VLVisionTower(VisionConfig.from_hf(cfg.vision_config), TORCH_OPS, torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in tower.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif param.dim() == 1:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
            elif name.startswith("pos_embed"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param[0].numel()))
    return tower.eval()


def preprocessor_config() -> dict:
    """preprocessor_config.json as Qwen3-VL ships it (HF's Qwen2-VL image processor), with tiny pixel bounds."""
    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
            "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255,
            "resample": 3, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
            "size": {"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS}}


def write_vl_model(out: Path, text_cfg: ModelConfig, text_model: nn.Module, tokenizer, seed: int = 0) -> ModelConfig:
    """Writes the VL checkpoint files next to the tokenizer files already in `out`; returns its config."""
    cfg = vl_config(text_cfg, tokenizer)
    tower = random_vision_tower(cfg, seed)
    tensors = {"model.language_model." + name.removeprefix("model."): t.contiguous()
               for name, t in text_model.hf_state_dict() if name.startswith("model.")}
    tensors.update({name: t.contiguous() for name, t in text_model.hf_state_dict() if name.startswith("lm_head.")})
    tensors.update({"model.visual." + name: t.contiguous() for name, t in tower.hf_state_dict()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    # The VL template in both places HF and orinfer look (chat_template.jinja wins when both exist).
    template = builtin_chat_template("qwen3_vl")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text(encoding="utf-8"))
    tok_config["chat_template"] = template
    tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    log.info("wrote tiny Qwen3-VL (vision tower %.2fM parameters) to %s",
             sum(p.numel() for p in tower.parameters()) / 1e6, out)
    return cfg
