"""A tiny Qwen3 made to answer with fixed tool calls, for the end-to-end tool-calling tests.

Its tokenizer is make-tiny's byte-level BPE (with Qwen's added tokens: <tool_call>, <think> are single tokens),
trained on the conversations below. The model memorises one answer per user message (the
trigger) and chat template: the answers are real tool calls in the Qwen3 JSON format under the Qwen3 template and
in the XML format under the Qwen3.5 (Qwen3.8-27B) template, with and without reasoning first, a call inside the
reasoning, plain text, and an answer to a tool result. The same weights serve two model directories, one per
template (`make_tool_models`). Training: full-batch AdamW on the answer tokens only (80 steps).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from orinfer.layers.attention import AttentionMetadata
from orinfer.layers.ops import TORCH_OPS
from orinfer.loader import random_model
from orinfer.tiny import tiny_config, torch_threads
from orinfer.tokenizer import Tokenizer
from orinfer.tokenizer_train import train_tokenizer

REAL = Path(__file__).parent / "data" / "real-qwen"   # published chat templates (see its README)
TEMPLATES = {"json": REAL / "Qwen3-8B" / "chat_template.jinja",
             "xml": REAL / "Qwen3.8-27B" / "chat_template.jinja"}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TOOLS = [WEATHER_TOOL]
CALL_ARGS = {"city": "Paris", "days": 3}
JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
ANSWER_TO_RESULT = "It is sunny in Paris."
RESULT = '{"sky": "sunny"}'

# (template, user message, with tools, enable_thinking, answer)
CASES = [
    ("json", "weather please", True, None, JSON_CALL),
    ("json", "weather please", False, None, JSON_CALL),
    ("json", "ponder the weather", True, None, "<think>\nThe user wants the weather.\n</think>\n\n" + JSON_CALL),
    ("json", "hello", True, None, "Hello! How can I help?"),
    ("xml", "weather please", True, None, "I need the weather tool.\n</think>\n\n" + XML_CALL),
    ("xml", "weather please", True, False, XML_CALL),
    ("xml", "weather please", False, None, "I need the weather tool.\n</think>\n\n" + XML_CALL),
    ("xml", "call inside", True, None, "Let me check.\n" + XML_CALL),
]


def result_turn(kind: str) -> list[dict]:
    """A conversation in which the weather call was made and answered: the model answers ANSWER_TO_RESULT."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)}}
    return [{"role": "user", "content": "weather please"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]


def _conversations(tok: dict[str, Tokenizer]) -> list[tuple[str, str]]:
    """(prompt, answer) pairs as the model is trained on them."""
    out = []
    for kind, user, with_tools, thinking, answer in CASES:
        prompt = tok[kind].apply_chat_template([{"role": "user", "content": user}], tools=TOOLS if with_tools else None,
                                               enable_thinking=thinking)
        out.append((prompt, answer))
    for kind, answer in (("json", ANSWER_TO_RESULT), ("xml", "The tool answered.\n</think>\n\n" + ANSWER_TO_RESULT)):
        messages = [dict(m) for m in result_turn(kind)]
        messages[1]["tool_calls"][0] = {**messages[1]["tool_calls"][0],
                                        "function": {"name": "get_weather", "arguments": CALL_ARGS}}
        out.append((tok[kind].apply_chat_template(messages, tools=TOOLS), answer))
    return out


def make_tool_models(root: Path, steps: int = 80, seed: int = 0, lr: float = 1e-2) -> dict[str, Path]:
    """Writes the two model directories ("json", "xml") under `root` and returns them."""
    base = root / "tokenizer"
    dirs = {kind: root / kind for kind in TEMPLATES}
    # The tokenizer is trained on the conversations themselves (rendering them needs only the template, no
    # vocabulary), so the long tool prompts take few tokens.
    tok = {}
    for kind, d in dirs.items():
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(TEMPLATES[kind], d / "chat_template.jinja")
        tok[kind] = Tokenizer(BackendTokenizer(BPE()), {}, {"default": TEMPLATES[kind].read_text()})
    pairs = _conversations(tok)
    final = train_tokenizer([p + a for p, a in pairs] * 4, 1024, base)
    eos = [final.token_to_id("<|im_end|>"), final.token_to_id("<|endoftext|>")]
    # Smaller than make-tiny's model (two layers, width 64): memorising ten answers needs little, and it trains in
    # a third of the time.
    config = replace(tiny_config("qwen3", final.vocab_size, eos), hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2)
    torch.manual_seed(seed)
    model = random_model(config, TORCH_OPS, torch.float32, torch.float32, torch.device("cpu"), seed=seed, std=0.05)
    # Whole prompts: trained on their last turns only, the model does not answer the whole prompts.
    seqs = [(final.encode(p), final.encode(a) + [eos[0]]) for p, a in pairs]
    with torch.enable_grad(), torch_threads(1):
        _train(model, seqs, steps, lr)
    weights = {name: t.contiguous() for name, t in model.hf_state_dict()}
    generation = {"eos_token_id": eos, "pad_token_id": eos[1], "do_sample": False}
    for d in dirs.values():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(base / name, d / name)
        save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
        (d / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return dirs


def _train(model: torch.nn.Module, seqs: list[tuple[list[int], list[int]]], steps: int, lr: float = 3e-3) -> float:
    """Full-batch training of every sequence at once (packed, variable lengths); loss on the answer tokens only."""
    ids = torch.tensor([t for p, a in seqs for t in p + a])
    lens = [len(p) + len(a) for p, a in seqs]
    starts = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    meta = AttentionMetadata(from_start=True, query_start_loc=starts, context_lens=torch.tensor(lens),
                             max_query_len=max(lens), max_context_len=max(lens))
    positions = torch.cat([torch.arange(n) for n in lens])
    targets = torch.full_like(ids, -100)
    at = 0
    for p, a in seqs:   # position i predicts token i+1: the last prompt token predicts the first answer token
        targets[at + len(p) - 1:at + len(p) + len(a) - 1] = torch.tensor(a)
        at += len(p) + len(a)
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        logits = model.compute_logits(model(ids, positions, meta))
        loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
    model.eval()
    for p in params:
        p.requires_grad_(False)
    return loss.item()
