"""Qwen3-VL (HF's Qwen3VLForConditionalGeneration): the vision tower in front of a Qwen3 decoder.

Data flow of a step with prompt rows of images (the runner passes a `MultimodalBatch`):

    pixel patches --vision tower--> visual embeddings [M, H] + DeepStack features (one [M, H] per tapped block)
    (`encode_images`, once per request; the runner hands each prompt chunk the rows it covers)
    token embeddings, with rows `visual_rows` (the <|image_pad|> placeholders) replaced by the visual embeddings
    -> decoder layers with M-RoPE (a per-token cos/sin table); after decoder layer i < len(DeepStack), feature i is
       added in place to the hidden states at the visual rows (the seed's DeepStack slice add)
    -> final norm -> lm_head

Everything else - text-only prompts, every decode step, CUDA-graph replay - is the plain Qwen3 path: M-RoPE of text
is ordinary RoPE, and a decode token's three positions are equal (n + delta, computed by the engine).

Checkpoint layout (transformers >= 4.57): "model.language_model.*" (decoder), "model.visual.*" (tower),
"lm_head.weight" (absent when tied). The Qwen2-VL-era layout ("model.*" decoder, "visual.*" tower) also loads, as
HF's conversion mapping for its VL models renames it.

Qwen3.5's ConditionalGeneration (models/qwen3_5_vl.py) is this class with another decoder (`decoder_class`): the same
tower without DeepStack, M-RoPE over the rotary share of each head (`cfg.rotary_dim` columns of the table).
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch
from torch import nn

from orinfer.config import ModelConfig
from orinfer.errors import ConfigError
from orinfer.layers.attention import Attention, AttentionMetadata
from orinfer.layers.mrope import MultimodalBatch, mrope_cos_sin, mrope_frequency_axes
from orinfer.layers.ops import Ops
from orinfer.models.qwen import LayerHook, QwenForCausalLM
from orinfer.models.qwen3_vl_vision import Qwen3VLVisionTower, VisionConfig
from orinfer.models.qwen3_vl_vision_graphs import VisionGraphCache

log = logging.getLogger(__name__)

TEXT_PREFIX = "model.language_model."
VISION_PREFIXES = ("model.visual.", "visual.")


class Qwen3VLForConditionalGeneration(nn.Module):
    """Vision tower + Qwen3 decoder. `forward(input_ids, positions, meta, mm=None)` returns final hidden states."""

    # Tells the runner to build a MultimodalBatch for prefills of sequences with images.
    supports_multimodal = True
    # The decoder: any QwenForCausalLM (its forward takes inputs_embeds, a per-token cos_sin and after_layer).
    decoder_class: type[QwenForCausalLM] = QwenForCausalLM
    # Checkpoint tensors outside "model." that belong to the decoder, under their own names.
    decoder_top_level: tuple[str, ...] = ("lm_head.",)
    # Prefix of the decoder's tensors in checkpoints.
    hf_prefix = TEXT_PREFIX
    # Tensor parallelism (distributed/sharding.py): the decoder splits as Qwen3 / Qwen3-MoE (fused experts too);
    # every rank holds the whole tower, which rank 0 alone runs (the runner encodes images there); the embeddings,
    # DeepStack features and M-RoPE positions reach the workers with the forward's inputs (MultimodalBatch).
    tensor_parallel_plan = {**QwenForCausalLM.tensor_parallel_plan, "whole": ("visual",)}

    def __init__(self, cfg: ModelConfig, ops: Ops, weight_dtype: torch.dtype, act_dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.vision_config is None or cfg.mrope_section is None:
            raise ConfigError(f"{cfg.architecture} needs vision_config and an M-RoPE section")
        self.config, self.act_dtype = cfg, act_dtype
        self.vision_config = VisionConfig.from_hf(cfg.vision_config)
        if self.vision_config.out_hidden_size != cfg.hidden_size:
            raise ConfigError(f"vision_config.out_hidden_size={self.vision_config.out_hidden_size} must equal the "
                              f"decoder's hidden_size={cfg.hidden_size}")
        if len(self.vision_config.deepstack_visual_indexes) > cfg.num_hidden_layers:
            raise ConfigError(f"{len(self.vision_config.deepstack_visual_indexes)} DeepStack features but only "
                              f"{cfg.num_hidden_layers} decoder layers to add them to")
        # The tower runs in the weight dtype: in "mixed" mode (16-bit weights, fp32 decoder activations) a 16-bit
        # tower halves its memory; its outputs are widened to the decoder's activation dtype.
        self.visual = Qwen3VLVisionTower(self.vision_config, ops, weight_dtype)
        self.vision_graphs: VisionGraphCache | None = None   # `enable_vision_graphs()`
        self.language_model = self.decoder_class(cfg, ops, weight_dtype, act_dtype)
        self.language_model.hf_prefix = self.hf_prefix
        # One axis per rotary frequency: rotary_dim / 2 of them (all of head_dim, or the partial-rotary share).
        self.register_buffer("mrope_axes", mrope_frequency_axes(cfg.rotary_dim, cfg.mrope_section), persistent=False)

    # --- forward ----------------------------------------------------------------------------------------------------

    def enable_vision_graphs(self) -> None:
        """Encode repeated image sizes through CUDA graphs of the tower (`qwen3_vl_vision_graphs`; CUDA only)."""
        self.vision_graphs = VisionGraphCache(self.visual)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The vision tower on patches [N, C] of images with (t, h, w) grids: (embeds [M, H], DeepStack features,
        each [M, H]) in the decoder's activation dtype, M = sum of t*h*w / merge**2."""
        embeds, deepstack = (self.vision_graphs or self.visual)(pixel_values, grid_thw)
        return embeds.to(self.act_dtype), [feature.to(self.act_dtype) for feature in deepstack]

    def warmup_images(self, num_patches: int) -> None:
        """Encodes one blank square image of about `num_patches` patches: the runner's memory probe, so that the KV
        cache leaves room for the tower's activations on the largest image."""
        if self.visual.ops.materializes_attention:
            # Attention that materialises [heads, N, N] scores (the torch reference): probing with the largest image
            # would itself exhaust memory. That backend is the correctness reference, not a serving path: no probe.
            log.info("%s backend: no vision-tower memory probe", self.visual.ops.name)
            return
        side = max(2, int(num_patches ** 0.5) // 2 * 2)
        device = self.mrope_axes.device
        pixels = torch.zeros(side * side, self.vision_config.patch_dim, device=device)
        self.encode_images(pixels, [(1, side, side)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                mm: MultimodalBatch | None = None) -> torch.Tensor:
        """Final hidden states [T, H]. Without `mm` (text, decode) this is exactly the decoder's forward."""
        if mm is None:
            return self.language_model(input_ids, positions, meta)
        text = self.language_model
        embeds = text.embed_tokens(input_ids)
        if mm.has_images:
            embeds[mm.visual_rows] = mm.embeds.to(embeds.dtype)
        cos_sin = mrope_cos_sin(text.rotary.cos_sin, mm.positions, self.mrope_axes)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        hook = _deepstack_hook(mm.visual_rows, mm.deepstack) if mm.has_images and mm.deepstack else None
        return text(input_ids, rows, meta, inputs_embeds=embeds, cos_sin=cos_sin, after_layer=hook)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return self.language_model.attention_layers()

    # --- weights ----------------------------------------------------------------------------------------------------

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fills the decoder and the tower from a checkpoint's tensors (either layout); WeightsError on a missing,
        mis-shaped or (for the tower) unknown tensor."""
        vision: list[tuple[str, torch.Tensor]] = []

        def decoder_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                prefix = next((p for p in VISION_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    # Held until the decoder is done: the tower checks completeness over all its tensors at once.
                    vision.append((name[len(prefix):], tensor))
                elif name.startswith((TEXT_PREFIX, *self.decoder_top_level)):
                    yield name, tensor
                elif name.startswith("model."):
                    yield TEXT_PREFIX + name[len("model."):], tensor
                else:
                    log.debug("ignoring checkpoint tensor %s", name)

        self.language_model.load_weights(decoder_tensors())
        self.visual.load_weights(vision)

    def hf_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under HF's names (transformers >= 4.57 layout); the inverse of load_weights."""
        yield from self.language_model.hf_state_dict()
        for name, tensor in self.visual.hf_state_dict():
            yield VISION_PREFIXES[0] + name, tensor


def _deepstack_hook(rows: torch.Tensor, features: list[torch.Tensor]) -> LayerHook:
    """after_layer hook: after decoder layer i < len(features), hidden[rows] += features[i] (in place).

    The layer's output stream (MLP output + residual) is materialised first, exactly as HF adds the feature to
    the layer output; the next layer then starts from that stream (residual None)."""
    def hook(index: int, hidden: torch.Tensor, residual: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if index >= len(features):
            return hidden, residual
        stream = hidden if residual is None else hidden + residual
        stream.index_add_(0, rows, features[index].to(stream.dtype))
        return stream, None
    return hook
