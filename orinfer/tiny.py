"""`orinfer make-tiny`: a small Qwen model in Hugging Face format, made and trained locally (no hub needed).

Steps: train a Qwen-style byte-level BPE tokenizer on the bundled public-domain text, build a small Qwen3 (or Qwen2)
decoder with orinfer's own layers, train it for a few seconds (160 steps) on that text so greedy decoding continues it, and write
config.json, model.safetensors, generation_config.json and the tokenizer files. HF transformers loads the result.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from orinfer.config import ModelConfig
from orinfer.layers.attention import AttentionMetadata
from orinfer.layers.ops import TORCH_OPS
from orinfer.loader import random_model
from orinfer.tokenizer_train import bundled_corpus, train_tokenizer

log = logging.getLogger(__name__)

ARCHES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3-vl": "Qwen3VLForConditionalGeneration"}


def tiny_config(arch: str, vocab_size: int, eos_ids: list[int]) -> ModelConfig:
    """Small but not trivial: GQA 2:1 and head_dim (32) != hidden/heads (24), as real Qwen3 checkpoints have."""
    return ModelConfig(
        architecture=ARCHES[arch], vocab_size=vocab_size, hidden_size=96, intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        attention_bias=arch == "qwen2", qk_norm=arch == "qwen3", torch_dtype="float32", eos_token_id=eos_ids)


def train_on_text(model: torch.nn.Module, tokens: torch.Tensor, steps: int, seq_len: int = 96,
                  batch: int = 24, lr: float = 4e-3, seed: int = 0, progress: bool = True) -> float:
    """Next-token training on random windows of `tokens` for `steps` AdamW steps; returns the last loss.

    A step count, not a time budget, so that the same seed gives the same model on any machine, however loaded.
    """
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    starts = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=True, query_start_loc=starts, context_lens=torch.full((batch,), seq_len),
                             max_query_len=seq_len, max_context_len=seq_len)
    positions = torch.arange(seq_len).repeat(batch)
    loss_value = float("nan")
    bar = tqdm(total=steps, desc="Training tiny model", unit="step", disable=not progress, leave=False)
    model.train()
    for step in range(steps):
        offsets = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=gen)
        windows = torch.stack([tokens[o:o + seq_len + 1] for o in offsets.tolist()])
        hidden = model(windows[:, :-1].reshape(-1), positions, meta)
        logits = model.compute_logits(hidden)
        loss = torch.nn.functional.cross_entropy(logits, windows[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        # A step schedule: a quarter of the rate for the last third settles the memorisation.
        for group in optim.param_groups:
            group["lr"] = lr if step < steps * 2 // 3 else lr / 4
        optim.step()
        loss_value = loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}")
    bar.close()
    model.eval()
    for p in params:
        p.requires_grad_(False)
    log.info("trained %d steps, final loss %.3f", steps, loss_value)
    return loss_value


def make_tiny(out_dir: str | Path, arch: str = "qwen3", train_steps: int = 160, vocab_size: int = 1024,
              seed: int = 0, progress: bool = True) -> Path:
    """Writes a trained tiny model to `out_dir` (created if needed) and returns its path.

    "qwen3-vl" trains the same language model as "qwen3" (same seed: same weights) and puts a random vision tower
    in front of it (orinfer/tiny_vl.py)."""
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = bundled_corpus()
    text_arch = "qwen3" if arch == "qwen3-vl" else arch
    tokenizer = train_tokenizer([text], vocab_size, out, arch=text_arch)
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    config = tiny_config(text_arch, tokenizer.vocab_size, eos)
    torch.manual_seed(seed)
    model = random_model(config, TORCH_OPS, torch.float32, torch.float32, torch.device("cpu"), seed=seed, std=0.05)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
    if train_steps > 0:
        with torch.enable_grad():
            train_on_text(model, tokens, train_steps, seed=seed, progress=progress)
    if arch == "qwen3-vl":
        from orinfer.tiny_vl import write_vl_model

        config = write_vl_model(out, config, model, tokenizer, seed=seed)
    else:
        save_file({name: t.contiguous() for name, t in model.hf_state_dict()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    # Qwen3's published sampling defaults, so the generation_config path is exercised like a real checkpoint.
    generation = {"bos_token_id": tokenizer.token_to_id("<|endoftext|>"), "eos_token_id": eos,
                  "pad_token_id": tokenizer.token_to_id("<|endoftext|>"), "do_sample": True,
                  "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    log.info("wrote %s model with %.2fM parameters to %s", config.architecture, config.num_parameters() / 1e6, out)
    return out
