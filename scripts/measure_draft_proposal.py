"""Host-side anatomy of a draft-model proposal on the CPU (issue 36): what a steady-state batch-1 proposal does.

Random weights: a 2-layer target and a draft of Qwen3-0.6B's 28 layers at tiny widths (what is counted scales with
layers, not widths), fp32 on the CPU, torch backend, forced acceptance 0.8, k = 4. Per proposal it counts aten ops
(each a kernel launch on the GPU when run eagerly; views excluded) and host time in the catch-up chunk and in the k
decode steps, and times the host bookkeeping a graph proposal needs instead (`fill_inputs`) against today's
(`flat_inputs` for the catch-up chunk). CPU wall times include the CPU's compute: the op counts are the point.

    PYTHONPATH=. python scripts/measure_draft_proposal.py

Result on the 2-core CPU box (2026-11-27, load ~2-4; times under the op counter are inflated, counts are exact):
24 steady-state proposals, 11 of them (46%; 0.8^4 = 41% expected) with a 1-token catch-up chunk (a fully accepted
verify step); a draft forward is 1895 aten ops (68 a layer on the torch backend), so a proposal is 4 forwards, 5
after a fully accepted step. Host bookkeeping: today's catch-up StepInputs (`flat_inputs`) 5 us at batch 1, 13 us
at batch 8, beside the mixed-step and decode graphs' own packing and uploads; a graph proposal's whole input
(`graph_feed` + `fill_inputs`: catch-up, k - 1 steps, tables) 22 us / 55 us (before fill_inputs built lists:
45 us / 287 us).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from orinfer.args import EngineArgs
from orinfer.bench.engine_bench import build_synthetic_llm
from orinfer.config import preset
from orinfer.sampling_params import SamplingParams
from orinfer.spec_decode.draft_graphs import graph_feed
from orinfer.spec_decode.draft_model import flat_inputs
from orinfer.spec_decode.proposal_graphs import InputLayout, fill_inputs

K = 4


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def tiny(cfg, layers: int):
    return dataclasses.replace(cfg, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=1024, num_hidden_layers=layers)


def main() -> None:
    torch.manual_seed(0)
    base = preset("qwen3-0.6b")
    args = EngineArgs(dtype="float32", device="cpu", backend="torch", max_model_len=512,
                      max_num_seqs=4, progress=False,
                      speculative_config={"method": "draft_model", "model": "synthetic-draft",
                                          "num_speculative_tokens": K, "forced_acceptance": 0.8})
    llm = build_synthetic_llm(tiny(base, 2), torch.float32, torch.device("cpu"), args, draft=tiny(base, 28))
    draft = llm.engine.draft
    records = []
    catch_up, steps = draft._catch_up, draft._greedy_steps

    def timed(name, fn):
        def wrapper(seqs):
            counter = OpCounter()
            rows = sum(len(s.token_ids) - 1 - s.num_draft_computed for s in seqs if name == "catch_up")
            start = time.perf_counter()
            with counter:
                out = fn(seqs)
            records.append((name, time.perf_counter() - start, sum(counter.ops.values()), rows, counter.ops))
            return out
        return wrapper

    draft._catch_up, draft._greedy_steps = timed("catch_up", catch_up), timed("steps", steps)
    prompt = list(range(1, 129))
    llm.generate([prompt], SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True))
    proposals = [r for r in records if r[0] == "steps"][1:]  # the first follows the prompt's catch-up
    catch_ups = [r for r in records[2:] if r[0] == "catch_up" and r[3] > 0]
    print(f"steady-state proposals: {len(proposals)}; with a catch-up chunk: {len(catch_ups)} "
          f"(rows {sorted(Counter(r[3] for r in catch_ups).items())})")
    print(f"k = {K} decode steps: {np.mean([r[2] for r in proposals]):.0f} aten ops a proposal "
          f"({np.mean([r[2] for r in proposals]) / K:.0f} a step), {np.mean([r[1] for r in proposals]) * 1e3:.2f} ms")
    if catch_ups:
        print(f"catch-up chunk: {np.mean([r[2] for r in catch_ups]):.0f} aten ops, "
              f"{np.mean([r[1] for r in catch_ups]) * 1e3:.2f} ms")
        print("catch-up ops by kind:", dict(catch_ups[0][4].most_common(12)))
    print("one decode step's ops by kind:", {k: v // K for k, v in proposals[0][4].most_common(12)})
    # Host bookkeeping: today's catch-up StepInputs against a graph proposal's fill_inputs (batch 1 and 8).
    seq = llm.engine.add_request(prompt, SamplingParams(max_tokens=8))
    seq.block_table = list(range(16))
    seq.num_draft_computed = len(seq.token_ids) - 2  # a fully accepted step: the last draft and the newest token
    for batch in (1, 8):
        seqs = [seq] * batch
        layout = InputLayout(max_batch=batch, k=K, max_blocks=32, rows_per_seq=2)
        host = {n: v.numpy() for n, v in layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8)).items()}
        reps = 2000
        start = time.perf_counter()
        for _ in range(reps):
            flat_inputs(seqs, [seq.token_ids[-2:-1]] * batch, [seq.num_draft_computed] * batch, 16)
        flat = (time.perf_counter() - start) / reps
        start = time.perf_counter()
        for _ in range(reps):
            firsts, feeds = zip(*(graph_feed(s.token_ids, s.num_draft_computed) for s in seqs))
            fill_inputs(host, batch, K, [s.block_table for s in seqs], list(feeds), list(firsts), 16)
        fill = (time.perf_counter() - start) / reps
        print(f"batch {batch}: flat_inputs (catch-up StepInputs) {flat * 1e6:.0f} us; graph_feed + fill_inputs "
              f"{fill * 1e6:.0f} us")


if __name__ == "__main__":
    main()
