"""`orinfer make-tiny`: a small Qwen model in Hugging Face format, made and trained locally (no hub needed).

Steps: train a Qwen-style byte-level BPE tokenizer on the bundled public-domain text, build a small Qwen3 (or Qwen2)
decoder with orinfer's own layers, train it for 160 steps (about half a minute of one CPU core) on that text so greedy
decoding continues it, and write config.json, model.safetensors, generation_config.json, the tokenizer files and
make_tiny.json (the arguments). HF transformers loads the result.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from orinfer.config import ModelConfig
from orinfer.layers.attention import AttentionMetadata
from orinfer.layers.ops import TORCH_OPS
from orinfer.loader import load_hf_model, random_model
from orinfer.tokenizer_train import bundled_corpus, train_tokenizer

log = logging.getLogger(__name__)

ARCHES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3-vl": "Qwen3VLForConditionalGeneration",
          "qwen3-moe": "Qwen3MoeForCausalLM"}
# qwen3-moe: 8 experts of width 64, 2 per token, in every layer but the first (a dense MLP: both kinds in one model).
_TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                 mlp_only_layers=(0,))
# Torch threads while training. On an idle machine more threads help a little (two cores: 0.13 s a step with two
# threads, 0.19 s with one), but on a busy one, with fewer free cores than threads, OpenMP's spinning barriers make
# every step crawl (two threads on two loaded cores: 7 s a step, against 0.5 s with one). One thread keeps the pace
# steady, and the thread count (so the order of the sums) does not vary with the machine's core count.
TRAIN_THREADS = 1
# Written next to the model: the `make_tiny` arguments that decide its weights (see `make_tiny`'s `text_model`).
RECIPE_FILE = "make_tiny.json"


def tiny_config(arch: str, vocab_size: int, eos_ids: list[int]) -> ModelConfig:
    """Small but not trivial: GQA 2:1 and head_dim (32) != hidden/heads (24), as real Qwen3 checkpoints have."""
    return ModelConfig(
        architecture=ARCHES[arch], vocab_size=vocab_size, hidden_size=96, intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        attention_bias=arch == "qwen2", qk_norm=arch != "qwen2", torch_dtype="float32", eos_token_id=eos_ids,
        **(_TINY_MOE if arch == "qwen3-moe" else {}))


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """At most `n` torch intra-op threads inside the block; the previous setting is restored afterwards."""
    before = torch.get_num_threads()
    if n < before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def train_on_text(model: torch.nn.Module, tokens: torch.Tensor, steps: int, seq_len: int = 96,
                  batch: int = 24, lr: float = 4e-3, seed: int = 0, progress: bool = True) -> float:
    """Next-token training on random windows of `tokens` for `steps` AdamW steps; returns the last loss.

    A step count, not a time budget, so that the same seed gives the same model on any machine, however loaded;
    run on `TRAIN_THREADS` torch threads (the caller's setting is restored afterwards), so that it does not slow to
    a crawl on a busy machine.
    """
    with torch_threads(TRAIN_THREADS):
        return _train(model, tokens, steps, seq_len, batch, lr, seed, progress)


def _train(model: torch.nn.Module, tokens: torch.Tensor, steps: int, seq_len: int, batch: int, lr: float, seed: int,
           progress: bool) -> float:
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    starts = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32)
    meta = AttentionMetadata(from_start=True, query_start_loc=starts, context_lens=torch.full((batch,), seq_len),
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
              seed: int = 0, progress: bool = True, text_model: str | Path | None = None) -> Path:
    """Writes a trained tiny model to `out_dir` (created if needed) and returns its path.

    "qwen3-vl" trains the same language model as "qwen3" (same seed: same weights) and puts a random vision tower
    in front of it (orinfer/tiny_vl.py). `RECIPE_FILE` records the arguments that decide the weights.

    `text_model`: a directory that `make_tiny` wrote for the language model's arch ("qwen3" for "qwen3-vl") with the
    same train_steps, vocab_size and seed (as its `RECIPE_FILE` says): its trained weights are taken instead of
    training them again, which gives the same files. Any other directory is a ValueError."""
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = bundled_corpus()
    text_arch = "qwen3" if arch == "qwen3-vl" else arch
    tokenizer = train_tokenizer([text], vocab_size, out, arch="qwen2" if arch == "qwen2" else "qwen3")
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    config = tiny_config(text_arch, tokenizer.vocab_size, eos)
    if text_model is not None:
        text_recipe = dict(arch=text_arch, train_steps=train_steps, vocab_size=vocab_size, seed=seed)
        model = _load_trained(Path(text_model), config, text_recipe)
    else:
        torch.manual_seed(seed)
        model = random_model(config, TORCH_OPS, torch.float32, torch.float32, torch.device("cpu"), seed=seed,
                             std=0.05)
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
    recipe = dict(arch=arch, train_steps=train_steps, vocab_size=vocab_size, seed=seed)
    (out / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
    log.info("wrote %s model with %.2fM parameters to %s", config.architecture, config.num_parameters() / 1e6, out)
    return out


def _load_trained(model_dir: Path, config: ModelConfig, recipe: dict) -> torch.nn.Module:
    """The trained model of an earlier `make_tiny` output, after checking that it was made with `recipe`."""
    try:
        found = json.loads((model_dir / RECIPE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        found = None
    if found != recipe:
        raise ValueError(f"text_model {model_dir}: not a make-tiny output made with {recipe} "
                         f"({RECIPE_FILE}: {found})")
    return load_hf_model(model_dir, TORCH_OPS, torch.float32, torch.float32, torch.device("cpu"), config,
                         progress=False)
