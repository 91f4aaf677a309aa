"""The scales of an fp8 KV cache, calibrated once at engine creation.

Each full-attention layer gets one fp32 scale per KV head for K and one for V (`kernels/kv_fp8.py` says why that
granularity and why powers of two). They come from one forward of CALIBRATION_TOKENS pseudo-random token ids
(a fixed seed, so every engine over the same weights gets the same scales) with no cache attached: every attention
layer records the largest |K| (after its norm and RoPE, as stored) and |V| per KV head, and the scale is the power
of two at or above KV_SCALE_HEADROOM times that over 448. The scales never change afterwards, so a value written
once is read back the same way by every later step; a later value beyond the headroom saturates at +-448 * scale.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from orinfer.engine.state_pools import StatePools
from orinfer.kernels.kv_fp8 import kv_scale_from_amax
from orinfer.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0x5EED


def calibration_ids(vocab_size: int, tokens: int) -> torch.Tensor:
    """The calibration prompt: `tokens` ids drawn uniformly from the vocabulary with a fixed seed (on the CPU, so
    every device and rank draws the same)."""
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (tokens,), generator=gen)


def calibrate_kv_scales(model: nn.Module, layers: list[nn.Module], state: StatePools, vocab_size: int,
                        max_model_len: int, device: torch.device) -> None:
    """Sets `k_scale` / `v_scale` [Hk] fp32 on every attention layer of `layers` from one calibration forward of
    `model` (whose forward runs those layers)."""
    tokens = max(1, min(CALIBRATION_TOKENS, max_model_len))
    for attn in layers:
        attn.k_scale = attn.v_scale = None  # a calibration forward attends over its own fresh K/V
        attn.kv_amax = torch.zeros(2, attn.num_kv_heads, dtype=torch.float32, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        from_start=True, query_start_loc=torch.tensor([0, tokens], **i32), context_lens=torch.tensor([tokens], **i32),
        max_query_len=tokens, max_context_len=tokens)
    try:
        with torch.inference_mode(), state.scratch(meta):  # (the scales below stay normal tensors)
            model(calibration_ids(vocab_size, tokens).to(device), torch.arange(tokens, device=device), meta)
        for attn in layers:
            attn.k_scale = kv_scale_from_amax(attn.kv_amax[0]).contiguous()
            attn.v_scale = kv_scale_from_amax(attn.kv_amax[1]).contiguous()
    finally:
        for attn in layers:
            attn.kv_amax = None
    log.info("fp8 KV cache: scales calibrated on %d tokens over %d layers", tokens, len(layers))
