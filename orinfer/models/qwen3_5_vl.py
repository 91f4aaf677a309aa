"""Qwen3.5 / 3.6 / 3.8 vision-language checkpoints (HF's Qwen3_5ForConditionalGeneration): Qwen3-VL's vision tower
without DeepStack in front of the hybrid Qwen3.5 decoder.

Everything image-side is Qwen3-VL's (`Qwen3VLForConditionalGeneration`, which this class specialises): the tower
and its CUDA graphs, `encode_images`, the memory probe, the visual rows of a prompt chunk replaced by the tower's
embeddings, M-RoPE positions computed as Qwen3-VL does. Two things differ and come from the config and the decoder:
- the M-RoPE table covers only the rotary share of each 256-dim head (partial rotary: rotary_dim = 64 columns,
  mrope_section [11, 11, 10] over its 32 frequencies); the rest of each head passes unturned, as on text;
- the tower's config lists no DeepStack taps (vl_config.py), so no feature is added after any decoder layer.

Text-only prompts and every decode step run the decoder's own forward, unchanged. Checkpoint layout:
"model.language_model.*" (decoder), "model.visual.*" (tower), "lm_head.weight", optionally "mtp.*" (the MTP head).
"""

from __future__ import annotations

import torch

from orinfer.models.qwen3_5 import GatedDeltaNetBlock, MTPHead, Qwen3_5ForCausalLM
from orinfer.models.qwen3_vl import Qwen3VLForConditionalGeneration


class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Vision tower + Qwen3.5 decoder (`language_model`). The runner sees the decoder's linear-attention state layers
    and MTP head through this wrapper."""

    decoder_class = Qwen3_5ForCausalLM
    decoder_top_level = ("lm_head.", "mtp.")
    # Tensor parallelism: the decoder splits as Qwen3_5ForCausalLM; every rank holds the whole tower, which rank 0
    # alone runs (the runner encodes images there; the embeddings reach the workers with the forward's inputs).
    tensor_parallel_plan = {**Qwen3_5ForCausalLM.tensor_parallel_plan, "whole": ("visual",)}

    def state_layers(self) -> list[GatedDeltaNetBlock]:
        """The decoder's layers with per-sequence state; the runner binds conv/ssm state pools to each."""
        return self.language_model.state_layers()

    @property
    def mtp(self) -> MTPHead | None:
        """The decoder's MTP head, or None when the checkpoint has none."""
        return self.language_model.mtp

    def mtp_forward(self, *args) -> torch.Tensor:
        """The decoder's MTP draft step (Qwen3_5ForCausalLM.mtp_forward)."""
        return self.language_model.mtp_forward(*args)
