"""`orinfer bench --speculative METHOD`: decode speed with speculative decoding against plain decoding, one engine.

On random weights real acceptance means nothing, so the drafts are accepted with forced probabilities (0.5 ... 1.0:
the output is then meaningless, which is why the report labels it). Two more rows bound the cost when speculation
does not pay: every draft rejected (forced 0), and the method's real behaviour on random weights (for n-grams on
random prompts: lookups that rarely match), with the acceptance it measured. Those rows speculate at every batch size;
a batch past the user's `max_batch` also gets a row with the default policy at forced acceptance 0.8, which shows the
engine turning speculation off where verifying would cost more than it saves.
"""

from __future__ import annotations

import dataclasses

import torch

from orinfer.bench.engine_bench import random_prompts
from orinfer.config import ModelConfig
from orinfer.llm import LLM
from orinfer.sampling_params import SamplingParams
from orinfer.spec_decode.config import SpeculativeConfig

ACCEPTANCES = (0.0, 0.5, 0.7, 0.8, 0.9, 1.0)
POLICY_ACCEPTANCE = 0.8  # the default-policy row's forced acceptance (the working point)
WARMUP_ACCEPTANCE, WARMUP_TOKENS = 0.5, 64


def _decode(llm: LLM, cfg: ModelConfig, batch: int, decode_tokens: int, prompt_len: int, seed: int) -> dict:
    """Decode tok/s of `batch` sequences (from the moment all have their first token to the last finish). Forced
    acceptance draws from torch's global generator: seeding it per row makes a row's acceptance pattern the same from
    run to run and commit to commit, so two runs' ratios compare the same draws (96 tokens are ~30 verify steps, too
    few for the average to settle)."""
    torch.manual_seed(seed)
    prompts = random_prompts(batch, prompt_len, cfg.vocab_size, seed)
    outs = llm.generate(prompts, SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True))
    start = max(o.metrics.ttft_s for o in outs)
    end = max(o.metrics.e2e_s for o in outs)
    tokens = sum(o.metrics.num_generated_tokens - 1 for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    steps = sum(o.metrics.num_verify_steps for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    return {"tok_s": tokens / (end - start), "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_verify": 1 + accepted / steps if steps else None, "verify_steps": steps}


def bench_speculation(llm: LLM, cfg: ModelConfig, spec: SpeculativeConfig, batch_sizes: list[int],
                      decode_tokens: int, prompt_len: int, acceptances=ACCEPTANCES) -> dict:
    """{batch: {"plain": row, "forced 0.5": row, ..., "real": row}}; each row's "speedup" is its tok/s over plain's
    in the same run. `spec.max_batch` is raised to the largest batch, so every batch speculates; a batch past the
    given `spec.max_batch` adds "default policy, forced 0.8" (that max_batch kept)."""
    engine = llm.engine
    policy = dataclasses.replace(spec, forced_acceptance=POLICY_ACCEPTANCE)
    spec = dataclasses.replace(spec, max_batch=max(batch_sizes), forced_acceptance=None)
    out: dict = {}
    for batch in batch_sizes:
        rows: dict = {}
        # Warm-up at this batch size, drafts accepted half the time: every number of accepted drafts (hence of
        # catch-up rows, rolled-back rows and verify rows) occurs, so the graphs captured on a shape's second
        # occurrence and the kernels compiled on first use are ready before any row is timed. (A warm-up whose drafts
        # were all rejected left them to the first timed rows: forced 0 - 0.7 then varied 0.31x - 0.94x between runs
        # of one tree, NOTES runs 378-380.)
        engine.set_speculation(dataclasses.replace(spec, forced_acceptance=WARMUP_ACCEPTANCE))
        _decode(llm, cfg, batch, WARMUP_TOKENS, prompt_len, 7)
        engine.set_speculation(None)
        rows["plain"] = _decode(llm, cfg, batch, decode_tokens, prompt_len, 100 + batch)
        for acceptance in acceptances:
            engine.set_speculation(dataclasses.replace(spec, forced_acceptance=acceptance))
            rows[f"forced {acceptance:g}"] = _decode(llm, cfg, batch, decode_tokens, prompt_len, 100 + batch)
        engine.set_speculation(spec)
        rows["real"] = _decode(llm, cfg, batch, decode_tokens, prompt_len, 100 + batch)
        if batch > policy.max_batch:
            engine.set_speculation(policy)
            rows[f"default policy, forced {POLICY_ACCEPTANCE:g}"] = _decode(llm, cfg, batch, decode_tokens,
                                                                           prompt_len, 100 + batch)
        engine.set_speculation(None)
        for row in rows.values():
            row["speedup"] = row["tok_s"] / rows["plain"]["tok_s"]
        out[batch] = rows
    return out


def speculation_markdown(spec: SpeculativeConfig, result: dict) -> list[str]:
    drafter = f" (draft: {spec.model})" if spec.model else ""
    if spec.quantization:
        drafter += f", {spec.quantization} drafter (spec_decode/drafter.py)"
    lines = ["", f"Speculative decoding: {spec.method}{drafter}, k = {spec.num_speculative_tokens} (forced rows: drafts accepted "
             "at random with that probability, output meaningless; real: the method on random weights)", "",
             "| batch | mode | decode tok/s | vs plain | acceptance | tokens per verify step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for batch, rows in result.items():
        for mode, row in rows.items():
            rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
            per_step = "-" if row["tokens_per_verify"] is None else f"{row['tokens_per_verify']:.2f}"
            lines.append(f"| {batch} | {mode} | {row['tok_s']:.0f} | {row['speedup']:.2f}x | {rate} | {per_step} |")
    return lines
