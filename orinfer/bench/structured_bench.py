"""`orinfer bench --structured TOKENIZER_DIR`: JSON-schema-constrained decode speed against unconstrained, one engine.

Issue 33's figure: at batch 64 constrained decoding must reach 90% of unconstrained tokens/s (95% at batch 1). Both
modes sample at temperature 1 from the same random prompts with the same engine, so the only difference is the
grammar: each step's masks built on the host (llguidance), uploaded and applied in the sampler. The schema is a
tool-like object of 20 fields, all required, strings capped at 8 characters: its shortest valid instance is longer
than the default 96 decode tokens, so no constrained row ends before the unconstrained ones (`min_tokens` in the
report shows it). The masks need the model's real tokenizer (their cost grows with the vocabulary): on random
weights, pass a directory with the tokenizer.json of the preset's family (Qwen3: /work/shared/real-qwen/Qwen3-0.6B).
"""

from __future__ import annotations

from orinfer.bench.engine_bench import random_prompts
from orinfer.config import ModelConfig
from orinfer.llm import LLM
from orinfer.sampling_params import SamplingParams


def tool_schema() -> dict:
    """A 20-field tool-like JSON schema (strings, enums, integers, numbers, booleans, arrays, a nested object)."""
    props: dict = {f"name_{i}": {"type": "string", "maxLength": 8} for i in range(6)}
    props["unit"] = {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]}
    props["mode"] = {"type": "string", "enum": ["fast", "slow", "balanced", "auto"]}
    props.update({f"count_{i}": {"type": "integer", "minimum": 0, "maximum": 1000} for i in range(4)})
    props["ratio"] = {"type": "number"}
    props["score"] = {"type": "number", "minimum": 0}
    props["enabled"] = {"type": "boolean"}
    props["verbose"] = {"type": "boolean"}
    props["tags"] = {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 5}
    props["ids"] = {"type": "array", "items": {"type": "integer"}, "maxItems": 5}
    props["location"] = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                         "properties": {"city": {"type": "string", "maxLength": 8},
                                        "country": {"type": "string", "maxLength": 8}}}
    props["note"] = {"type": ["string", "null"], "maxLength": 8}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _decode(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Decode tok/s of the batch, from the moment every sequence has its first token to the last finish."""
    outs = llm.generate(prompts, params)
    start = max(o.metrics.ttft_s for o in outs)
    end = max(o.metrics.e2e_s for o in outs)
    tokens = [o.metrics.num_generated_tokens for o in outs]
    return {"tok_s": sum(t - 1 for t in tokens) / (end - start), "min_tokens": min(tokens),
            "max_tokens": max(tokens), "texts": [o.text for o in outs]}


def bench_structured(llm: LLM, cfg: ModelConfig, batch_sizes: list[int], decode_tokens: int, prompt_len: int,
                     repeats: int = 2) -> dict:
    """{batch: {"plain": row, "json": row, "ratio": json tok/s / plain tok/s}}, each row the last of `repeats` runs
    (the first ones warm up graphs, kernels and the host's allocators). Rows: tok_s, min_tokens, max_tokens."""
    schema = tool_schema()
    base = dict(max_tokens=decode_tokens, temperature=1.0, ignore_eos=True)
    plain, constrained = SamplingParams(**base), SamplingParams(**base, structured_outputs={"json": schema})
    # Warm-up: the tokenizer set up for the grammar library, the schema compiled (cached from then on).
    llm.generate(random_prompts(1, prompt_len, cfg.vocab_size, 5), SamplingParams(**{**base, "max_tokens": 8},
                                                                                 structured_outputs={"json": schema}))
    out: dict = {}
    for batch in batch_sizes:
        prompts = random_prompts(batch, prompt_len, cfg.vocab_size, 300 + batch)
        rows: dict = {}
        for _ in range(repeats):
            rows["plain"] = _decode(llm, prompts, plain)
            rows["json"] = _decode(llm, prompts, constrained)
        for row in rows.values():
            row.pop("texts")
        rows["ratio"] = rows["json"]["tok_s"] / rows["plain"]["tok_s"]
        out[batch] = rows
    return out


def structured_markdown(result: dict) -> list[str]:
    lines = ["", "Structured outputs: a 20-field JSON schema (llguidance) against unconstrained, temperature 1", "",
             "| batch | unconstrained tok/s | JSON-constrained tok/s | ratio | constrained tokens (min-max) |",
             "| --- | --- | --- | --- | --- |"]
    for batch, rows in result.items():
        j = rows["json"]
        lines.append(f"| {batch} | {rows['plain']['tok_s']:.0f} | {j['tok_s']:.0f} | {100 * rows['ratio']:.1f}% | "
                     f"{j['min_tokens']}-{j['max_tokens']} |")
    return lines
