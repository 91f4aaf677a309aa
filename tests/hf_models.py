"""Tiny random Qwen models built with HF transformers' own classes: the reference for orinfer's correctness tests."""

from __future__ import annotations

import math
from pathlib import Path

import torch

# Odd shapes on purpose: GQA 1:1, 2:1 and 4:1, head_dim != hidden/heads, tied and untied heads.
CONFIGS = {
    "qwen3-gqa4-untied": dict(arch="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=24, intermediate_size=96, num_hidden_layers=3, tie_word_embeddings=False),
    "qwen3-mha-tied": dict(arch="qwen3", hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
                           head_dim=16, intermediate_size=80, num_hidden_layers=2, tie_word_embeddings=True),
    "qwen2-gqa2-untied": dict(arch="qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, intermediate_size=112, num_hidden_layers=2, tie_word_embeddings=False),
    "qwen2-gqa4-tied": dict(arch="qwen2", hidden_size=96, num_attention_heads=8, num_key_value_heads=2,
                            head_dim=20, intermediate_size=64, num_hidden_layers=2, tie_word_embeddings=True),
}


def build_hf_model(kind: str, vocab_size: int = 211, seed: int = 0):
    """An HF Qwen2/Qwen3 causal LM with weights large enough that greedy choices are not near-ties."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    spec = dict(CONFIGS[kind])
    arch = spec.pop("arch")
    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(vocab_size=vocab_size, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                        bos_token_id=None, eos_token_id=vocab_size - 1, pad_token_id=None, **spec)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif param.dim() == 1:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1]))
    return model


def save_hf_model(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by full recomputation (no cache tricks): the plainest possible reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]
