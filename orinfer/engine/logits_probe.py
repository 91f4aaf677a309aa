"""Every position's logits of one token sequence through an engine's real paged path: for checks against a reference
model (tests, `orinfer.bench.fp8_accuracy`), not for serving."""

from __future__ import annotations

from typing import Any

import torch

from orinfer.engine.scheduler import StepPlan
from orinfer.engine.sequence import Sequence
from orinfer.sampling_params import SamplingParams


def paged_logits(llm: Any, ids: list[int], prefill_len: int, mm: Any = None) -> torch.Tensor:
    """Logits [len(ids), vocab] of `llm` (an orinfer.LLM): a prefill of the first `prefill_len` tokens (every row's
    logits; with `mm`, a Qwen3-VL MultimodalInputs, the images go through the runner's batch), then one decode step
    per remaining token. The prefix cache is bypassed, so no row comes from an earlier sequence."""
    engine, runner = llm.engine, llm.engine.runner
    seq = Sequence("probe", ids[:prefill_len], SamplingParams(max_tokens=1, temperature=0.0), mm=mm)
    caching = engine.block_manager.enable_prefix_caching
    engine.block_manager.enable_prefix_caching = False  # every row's logits: no prefix may come from the cache
    try:
        engine.block_manager.allocate(seq)
    finally:
        engine.block_manager.enable_prefix_caching = caching
    rows = []
    try:
        with torch.inference_mode():
            plan = StepPlan([seq], [prefill_len])
            input_ids, positions, meta, _ = runner.prepare(plan)
            batch = runner.prepare_multimodal(plan)
            extra = () if batch is None else (batch,)
            rows.append(runner.model.compute_logits(runner.model(input_ids, positions, meta, *extra)))
            seq.num_computed_tokens = prefill_len
            for token in ids[prefill_len:]:
                seq.append_token(token)
                engine.block_manager.append_slot(seq)
                input_ids, positions, meta, _ = runner.prepare(StepPlan([seq], [1]))
                rows.append(runner.model.compute_logits(runner.model(input_ids, positions, meta)))
                seq.num_computed_tokens += 1
    finally:
        engine.block_manager.free(seq)
    return torch.cat(rows)
