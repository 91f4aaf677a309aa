"""Per-mask cost of the grammar libraries on the host, as the engine's batch sees it: 64 matchers a step.

Usage: python scripts/bench_grammar_masks.py TOKENIZER_JSON [--lib llguidance|xgrammar|both]
       [--schema bench|bench-nocap|tool ...] [--rows 64] [--steps 96] [--passes 2]
       [--slices engine|library] [--templates N]

Each pass starts `rows` fresh matchers of one compiled schema and walks them `steps` tokens: every step each
matcher's mask is computed alone (timed), then a token drawn uniformly from the mask's allowed ids (end-of-sequence
ids excluded, as the bench's `ignore_eos`) is consumed. A uniform draw is what `orinfer bench --structured` does on
random weights at temperature 1. Reported: per-mask mean / p99 / max (the computing thread's CPU time), and per
step the sum and the max of the `rows` masks (one thread computes the sum; with many threads and independent
matchers, the max bounds the step). The last pass is reported (the first also warms the libraries' lazily built
lexer states, as the bench's warm-up run does). A final pass times each library's own parallel batch call
(llguidance's LLExecutor, xgrammar's BatchGrammarMatcher) per step, in wall time: meaningful only on an idle
machine with several cores (the device's host), where llguidance's `--templates 1` against the default shows
what copies of one template sharing its lexer lock cost.

Schemas: "bench" is `orinfer/bench/structured_bench.tool_schema()` exactly; "bench-nocap" the same without its
`maxLength` caps; "tool" a typical function-calling argument schema. Both libraries get the engine's JSON layout
(", " and ": " separators, no free whitespace). llguidance runs through the engine's GrammarCompiler. xgrammar is
read from wherever it is importable (not a dependency of orinfer; only this script imports it, and it imports
transformers itself).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import llguidance
import numpy as np
import torch

from orinfer.bench.structured_bench import tool_schema
from orinfer.structured.grammar import MAX_TEMPLATES, GrammarCompiler
from orinfer.structured.params import StructuredOutputsParams

VOCAB_SIZE = 151936  # Qwen3's logits width (the tokenizer has 151,669 ids)
EOS_IDS = [151643, 151645]  # <|endoftext|>, <|im_end|>


def uncapped(schema: dict) -> dict:
    """`schema` without any maxLength."""
    if isinstance(schema, dict):
        return {k: uncapped(v) for k, v in schema.items() if k != "maxLength"}
    if isinstance(schema, list):
        return [uncapped(v) for v in schema]
    return schema


def function_schema() -> dict:
    """The arguments of a typical tool: free strings, an enum, bounded integers, a boolean, a string array."""
    return {"type": "object", "additionalProperties": False, "required": ["query", "location", "unit"],
            "properties": {"query": {"type": "string", "description": "what to look up"},
                           "location": {"type": "string", "description": "city and country"},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                           "include_hourly": {"type": "boolean"},
                           "sources": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}


SCHEMAS = {"bench": tool_schema, "bench-nocap": lambda: uncapped(tool_schema()), "tool": function_schema}


class Llg:
    """llguidance through orinfer's own compiler: its JSON options, vocabulary slices and templates (`lease`)."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, slices: list[str] | None = None, templates: int = MAX_TEMPLATES) -> None:
        self.lib, self.text = llguidance, open(tokenizer_json).read()
        start = time.perf_counter()
        self.compiler = GrammarCompiler(self.text, VOCAB_SIZE, EOS_IDS, max_templates=templates)
        if slices is not None:
            self.compiler._tokenizer = llguidance.LLTokenizer(self.text, n_vocab=VOCAB_SIZE, eos_token=EOS_IDS,
                                                              slices=slices)
        self.compiler.tokenizer  # noqa: B018 (the lazy setup, timed here)
        self.setup_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor()
        self.releases: list = []

    def compile(self, schema: dict) -> StructuredOutputsParams:
        """Compiles `schema` from scratch (its cached templates dropped first)."""
        self.compiler._cache.clear()
        spec = StructuredOutputsParams(json=schema)
        self.compiler.matcher(spec)
        return spec

    def fresh(self, spec: StructuredOutputsParams):
        matcher, release = self.compiler.lease(spec)
        self.releases.append(release)
        return matcher

    def done(self) -> None:
        """The pass's sequences are over: their templates are free for the next pass."""
        for release in self.releases:
            release()
        self.releases = []

    def fill(self, matcher, row: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def fill_batch(self, matchers: list, mask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                              mask.shape[1] * 4, mask.shape[0])


class Xgr:
    """xgrammar 0.2, its tokenizer info built from the same tokenizer.json (through transformers' wrapper)."""

    name = "xgrammar"

    def __init__(self, tokenizer_json: str) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self.lib = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)
        start = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB_SIZE, stop_token_ids=EOS_IDS)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def fresh(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matcher, row: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(row.unsqueeze(0))

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self) -> None:
        pass

    def fill_batch(self, matchers: list, mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, mask)


def allowed(row: torch.Tensor) -> np.ndarray:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:VOCAB_SIZE]
    ids = np.flatnonzero(bits)
    return ids[~np.isin(ids, EOS_IDS)]


def walk(lib, compiled, rows: int, steps: int, seed: int, batch: bool = False) -> dict:
    """One pass: per-mask times (s) and per-step sum/max, or per-step batch-call times when `batch`."""
    rng = np.random.default_rng(seed)
    matchers = [lib.fresh(compiled) for _ in range(rows)]
    live = list(range(rows))
    mask = torch.zeros(rows, (VOCAB_SIZE + 31) // 32, dtype=torch.int32)
    per_mask, step_sum, step_max, step_batch = [], [], [], []
    for _ in range(steps):
        if not live:
            break
        if batch:
            start = time.perf_counter()
            lib.fill_batch([matchers[i] for i in live], mask)
            step_batch.append(time.perf_counter() - start)
            rows_of = {i: mask[k] for k, i in enumerate(live)}
        else:
            times = []
            for i in live:
                start = time.thread_time()  # CPU time: the shared 2-core box's load does not enter
                lib.fill(matchers[i], mask[i])
                times.append(time.thread_time() - start)
            per_mask += times
            step_sum.append(sum(times))
            step_max.append(max(times))
            rows_of = {i: mask[i] for i in live}
        for i in list(live):
            ids = allowed(rows_of[i])
            if len(ids) == 0:  # only EOS left: the value is complete
                live.remove(i)
                continue
            assert lib.consume(matchers[i], int(rng.choice(ids))), f"{lib.name} refused a token its mask allowed"
    lib.done()
    return {"per_mask": per_mask, "step_sum": step_sum, "step_max": step_max, "step_batch": step_batch}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def measure(lib, schema: dict, rows: int, steps: int, passes: int) -> dict:
    compiles = []
    for _ in range(5):
        start = time.perf_counter()
        compiled = lib.compile(copy.deepcopy(schema))
        compiles.append(time.perf_counter() - start)
    for p in range(passes):
        result = walk(lib, compiled, rows, steps, seed=p)
    batch = walk(lib, compiled, rows, steps, seed=passes, batch=True)["step_batch"]
    ms = 1e3
    return {"compile_first_ms": compiles[0] * ms, "compile_median_ms": statistics.median(compiles) * ms,
            "masks": len(result["per_mask"]),
            "mask_mean_ms": statistics.mean(result["per_mask"]) * ms, "mask_p99_ms": pct(result["per_mask"], 99) * ms,
            "mask_max_ms": max(result["per_mask"]) * ms,
            "step_sum_mean_ms": statistics.mean(result["step_sum"]) * ms,
            "step_sum_p99_ms": pct(result["step_sum"], 99) * ms,
            "step_max_mean_ms": statistics.mean(result["step_max"]) * ms,
            "step_max_p99_ms": pct(result["step_max"], 99) * ms,
            "batch_call_mean_ms": statistics.mean(batch) * ms, "batch_call_p99_ms": pct(batch, 99) * ms}


def compare_templates(tokenizer_json: str, schema: dict, rows: int, steps: int, passes: int) -> None:
    """llguidance's batch call per step (LLExecutor, its default threads, wall time): `rows` copies of one template
    against `rows` copies of as many templates, walking the same tokens, the two timed alternately at each step so
    the machine's load weighs on both alike. The masks are checked equal."""
    text = open(tokenizer_json).read()
    one = GrammarCompiler(text, VOCAB_SIZE, EOS_IDS, max_templates=1)
    many = GrammarCompiler(text, VOCAB_SIZE, EOS_IDS, max_templates=rows)
    many._tokenizer = one.tokenizer
    spec, executor = StructuredOutputsParams(json=schema), llguidance.LLExecutor()
    words = (VOCAB_SIZE + 31) // 32
    for p in range(passes):
        rng = np.random.default_rng(p)
        shared, own = [one.lease(spec) for _ in range(rows)], [many.lease(spec) for _ in range(rows)]
        masks = {id(leases): torch.zeros(rows, words, dtype=torch.int32) for leases in (shared, own)}
        times: dict[int, list[float]] = {id(shared): [], id(own): []}
        for step in range(steps):
            for leases in (shared, own) if step % 2 else (own, shared):
                mask = masks[id(leases)]
                start = time.perf_counter()
                executor.unsafe_compute_mask_ptr([(m, i) for i, (m, _) in enumerate(leases)], mask.data_ptr(),
                                                 words * 4, rows)
                times[id(leases)].append(time.perf_counter() - start)
            assert torch.equal(masks[id(shared)], masks[id(own)])
            for i in range(rows):
                ids = allowed(masks[id(shared)][i])
                token = int(rng.choice(ids)) if len(ids) else EOS_IDS[0]
                assert shared[i][0].consume_token(token) and own[i][0].consume_token(token)
        for _, release in shared + own:
            release()
        a, b = times[id(shared)], times[id(own)]
        print(f"pass {p}: batch call, {rows} copies of one template {1e3 * statistics.mean(a):.2f} ms/step "
              f"(p99 {1e3 * pct(a, 99):.1f}); of {rows} templates {1e3 * statistics.mean(b):.2f} ms/step "
              f"(p99 {1e3 * pct(b, 99):.1f})", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer_json")
    ap.add_argument("--lib", choices=["llguidance", "xgrammar", "both"], default="both")
    ap.add_argument("--schema", nargs="+", choices=list(SCHEMAS), default=list(SCHEMAS))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--slices", choices=["engine", "library"], default="engine",
                    help="llguidance's vocabulary slices: the engine's (with string bodies of 1-8 characters) or the "
                         "library's default")
    ap.add_argument("--templates", type=int, default=MAX_TEMPLATES,
                    help="llguidance: independent templates per constraint (1: every row a copy of one template, "
                         "all waiting on its lock in the batch call)")
    ap.add_argument("--compare-templates", action="store_true",
                    help="only llguidance's batch call with one template against one template a row "
                         "(`compare_templates`), on the first --schema")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.compare_templates:
        compare_templates(args.tokenizer_json, SCHEMAS[args.schema[0]](), args.rows, args.steps, args.passes + 1)
        return
    slices = None if args.slices == "engine" else llguidance.LLTokenizer.general_slices()
    libs = {"llguidance": lambda path: Llg(path, slices, args.templates), "xgrammar": Xgr}
    for name in (["llguidance", "xgrammar"] if args.lib == "both" else [args.lib]):
        lib = libs[name](args.tokenizer_json)
        print(f"{name}: tokenizer setup {lib.setup_s:.2f} s", flush=True)
        for schema_name in args.schema:
            row = measure(lib, SCHEMAS[schema_name](), args.rows, args.steps, args.passes)
            print(name, schema_name, json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
