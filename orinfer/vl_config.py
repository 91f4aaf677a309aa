"""The vision-language extras of a config.json (Qwen3-VL, Qwen3.5 / 3.6 / 3.8 ConditionalGeneration checkpoints, and
their MoE variants).

`vl_fields` turns the top-level `vision_config`, the placeholder token ids and the text side's M-RoPE split into
ModelConfig keyword arguments. The two families read them alike and differ in their defaults (HF's config classes'
values) and in the vision tower: Qwen3.5's has no DeepStack.
"""

from __future__ import annotations

from typing import Any

from orinfer.errors import ConfigError
from orinfer.moe_config import QWEN3_5_MOE_VL_ARCHITECTURE, QWEN3_VL_MOE_ARCHITECTURE

VL_ARCHITECTURE = "Qwen3VLForConditionalGeneration"
QWEN3_5_VL_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"

# HF's defaults per architecture (Qwen3VLConfig / Qwen3_5Config and their text rotary embeddings), used when a
# config leaves a field out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    VL_ARCHITECTURE: dict(mrope_section=[24, 20, 20], image_token_id=151655, video_token_id=151656,
                          vision_start_token_id=151652, vision_end_token_id=151653),
    QWEN3_5_VL_ARCHITECTURE: dict(mrope_section=[11, 11, 10], image_token_id=248056, video_token_id=248057,
                                  vision_start_token_id=248053, vision_end_token_id=248054),
}
# The MoE variants: the same towers, ids and sections.
_DEFAULTS[QWEN3_VL_MOE_ARCHITECTURE] = _DEFAULTS[VL_ARCHITECTURE]
_DEFAULTS[QWEN3_5_MOE_VL_ARCHITECTURE] = _DEFAULTS[QWEN3_5_VL_ARCHITECTURE]
VL_ARCHITECTURES = tuple(_DEFAULTS)
# Towers without DeepStack (Qwen3.5's).
_NO_DEEPSTACK = (QWEN3_5_VL_ARCHITECTURE, QWEN3_5_MOE_VL_ARCHITECTURE)
_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vl_fields(raw: dict[str, Any], text: dict[str, Any], rotary_dim: int, arch: str, source: str
              ) -> dict[str, Any]:
    """ModelConfig's vision_config, placeholder ids and M-RoPE section for a checkpoint of `arch`.

    The section splits the rotary_dim/2 frequencies (all of head_dim, or the turned share under partial rotary) over
    the (t, h, w) axes. It lives in text_config's rope_scaling (checkpoints written by transformers 4.57) or
    rope_parameters (transformers 5); like HF, rope_scaling wins when both exist. Both families always interleave
    the axes over the frequencies (HF ignores `mrope_interleaved`), so that flag is not kept.
    """
    defaults = _DEFAULTS[arch]
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError(f"{source}: {arch} needs a 'vision_config' object")
    vision = dict(vision)
    if arch in _NO_DEEPSTACK:
        # Qwen3.5's tower has no DeepStack: HF's config class has no such field (published configs write [] and HF
        # ignores it), so the tower is built with none whatever the file says.
        vision["deepstack_visual_indexes"] = []
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    section = rope.get("mrope_section", defaults["mrope_section"]) if isinstance(rope, dict) \
        else defaults["mrope_section"]
    if (not isinstance(section, (list, tuple)) or len(section) != 3
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)):
        raise ConfigError(f"{source}: mrope_section must be three non-negative integers, got {section!r}")
    if sum(section) > rotary_dim // 2:
        raise ConfigError(f"{source}: mrope_section {list(section)} covers {sum(section)} rotary frequencies; "
                          f"the {rotary_dim} rotary dims of a head have only {rotary_dim // 2}")
    ids = {}
    for key in _IDS:
        value = raw.get(key, defaults[key])
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
        ids[key] = value
    return dict(vision_config=vision, mrope_section=tuple(section), **ids)
