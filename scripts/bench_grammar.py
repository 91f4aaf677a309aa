"""Measures grammar libraries for structured outputs on the host: tokenizer setup, JSON-schema compile, per-token mask.

Usage: python scripts/bench_grammar.py TOKENIZER_JSON [--lib llguidance|xgrammar|both]

The schema is a tool-like object of 20 fields (strings, enums, integers, numbers, booleans, arrays, a nested object).
Per-token mask time is the mean over the tokens of a valid instance (mask computed, then the token consumed).
xgrammar is measured through transformers' tokenizer wrapper (only this script imports transformers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

VOCAB_SIZE = 151936  # Qwen3's logits width (the tokenizer has fewer ids)


def tool_schema() -> dict:
    props: dict = {}
    for i in range(6):
        props[f"name_{i}"] = {"type": "string", "maxLength": 40}
    props["unit"] = {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]}
    props["mode"] = {"type": "string", "enum": ["fast", "slow", "balanced", "auto"]}
    for i in range(4):
        props[f"count_{i}"] = {"type": "integer", "minimum": 0, "maximum": 1000}
    props["ratio"] = {"type": "number"}
    props["score"] = {"type": "number", "minimum": 0}
    props["enabled"] = {"type": "boolean"}
    props["verbose"] = {"type": "boolean"}
    props["tags"] = {"type": "array", "items": {"type": "string"}, "maxItems": 5}
    props["ids"] = {"type": "array", "items": {"type": "integer"}}
    props["location"] = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                         "required": ["city"], "additionalProperties": False}
    props["note"] = {"type": ["string", "null"]}
    return {"type": "object", "properties": props, "required": list(props)[:12], "additionalProperties": False}


def instance() -> dict:
    out = {f"name_{i}": f"value number {i}" for i in range(6)}
    out.update(unit="celsius", mode="balanced", count_0=1, count_1=22, count_2=333, count_3=0, ratio=0.25,
               score=12.5, enabled=True, verbose=False, tags=["a", "bb"], ids=[1, 2, 3],
               location={"city": "Paris", "country": "France"}, note=None)
    return out


def bench_llguidance(path: str, schema: dict, text: str) -> dict:
    """Setup, compile and per-token mask times of llguidance (the library orinfer uses)."""
    import llguidance
    import llguidance.torch as lltorch
    import tokenizers

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(open(path).read(), n_vocab=VOCAB_SIZE)
    setup = time.perf_counter() - t0
    ids = tokenizers.Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids
    compiles = []
    for _ in range(5):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        m = llguidance.LLMatcher(tok, grammar)
        assert not m.is_error(), m.get_error()
        compiles.append(time.perf_counter() - t0)
    mask = lltorch.allocate_token_bitmask(1, VOCAB_SIZE)
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    per = []
    for t in ids:
        t0 = time.perf_counter()
        lltorch.fill_next_token_bitmask(m, mask)
        per.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return dict(setup_s=setup, compile_first_ms=compiles[0] * 1e3, compile_median_ms=statistics.median(compiles) * 1e3,
                mask_mean_us=statistics.mean(per) * 1e6, mask_max_us=max(per) * 1e6, tokens=len(ids))


def bench_xgrammar(path: str, schema: dict, text: str) -> dict:
    """The same for xgrammar (through transformers' tokenizer wrapper)."""
    import torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=path)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB_SIZE)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    ids = hf.encode(text, add_special_tokens=False)
    compiles = []
    for _ in range(5):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        compiles.append(time.perf_counter() - t0)
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        per.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    del torch
    return dict(setup_s=setup, compile_first_ms=compiles[0] * 1e3, compile_median_ms=statistics.median(compiles) * 1e3,
                mask_mean_us=statistics.mean(per) * 1e6, mask_max_us=max(per) * 1e6, tokens=len(ids))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer_json")
    ap.add_argument("--lib", choices=["llguidance", "xgrammar", "both"], default="both",
                    help="xgrammar must be importable for it (not a dependency of orinfer)")
    args = ap.parse_args(argv)
    schema, text = tool_schema(), json.dumps(instance())
    libs = ["llguidance", "xgrammar"] if args.lib == "both" else [args.lib]
    for lib in libs:
        fn = bench_llguidance if lib == "llguidance" else bench_xgrammar
        print(lib, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in fn(args.tokenizer_json,
                                                                                            schema, text).items()}))


if __name__ == "__main__":
    main()
