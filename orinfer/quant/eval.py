"""Perplexity of a loaded model on a text: the quality check for quantization."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from orinfer.quant.awq import calibration_batch


@torch.no_grad()
def perplexity(llm, text: str | list[int], window: int = 512) -> float:
    """exp(mean next-token negative log-likelihood) of `text` (a string, encoded with the model's tokenizer, or
    token ids) under `llm` (an `orinfer.LLM`), scored in independent windows of `window` tokens (every window is
    one prefill of the loaded model without the KV cache; the first token of each window is context only)."""
    model = llm.engine.runner.model
    ids = llm.tokenizer.encode(text) if isinstance(text, str) else list(text)
    if len(ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    device = next(model.parameters()).device
    window = min(window, model.config.max_position_embeddings)
    input_ids, positions, meta = calibration_batch(ids, window, len(ids), device)
    logits = model.compute_logits(model(input_ids, positions, meta)).float()
    starts = meta.query_start_loc.tolist()
    nll, count = 0.0, 0
    for a, b in zip(starts[:-1], starts[1:]):
        nll += F.cross_entropy(logits[a:b - 1], input_ids[a + 1:b], reduction="sum").item()
        count += b - a - 1
    return math.exp(nll / count)
