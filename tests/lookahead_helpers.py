"""What the lookahead tests share: an engine with or without one-step lookahead on the tiny model, the prompts, and
everything a caller sees of the outputs (tokens, text, finish reason, log-probabilities) for comparing two engines."""

from __future__ import annotations

from orinfer import LLM

PROMPTS = ["Alice was beginning", "Down, down, down.", "The rabbit-hole went", "She took down a jar"]


def lookahead_llm(tiny_dir, lookahead: bool, **kwargs) -> LLM:
    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False, async_scheduling=lookahead, **kwargs)


def seen(outs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason, [(lp.token_id, lp.top) for lp in o.logprobs]) for o in outs]
