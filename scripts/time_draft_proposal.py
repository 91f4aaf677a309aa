"""Device time of one draft-model proposal (issue 36), graph path against the eager one, on random weights.

Builds the bench's engine (a random target, a random draft, method draft_model, k drafts), decodes one sequence of
a `--prompt-len` prompt a few steps without speculation, then times, per proposal (synchronized, median of
`--reps`): the proposal graph with one catch-up row (after a partly accepted verify step) and with two (after a
fully accepted one), the same two states through the eager path (a catch-up chunk through the draft's mixed-step
graph, then k decode-graph replays), and the k decode-graph replays alone (what one draft forward costs).

    python3 scripts/time_draft_proposal.py [--target qwen3-8b] [--draft qwen3-0.6b] [--k 4] [--batch 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from orinfer.args import EngineArgs
from orinfer.bench.engine_bench import build_synthetic_llm
from orinfer.config import preset
from orinfer.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen3-8b")
    p.add_argument("--draft", default="qwen3-0.6b")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    engine_args = EngineArgs(dtype=str(dtype).removeprefix("torch."), device=args.device,
                             max_model_len=args.prompt_len + 64, max_num_seqs=max(8, args.batch), progress=False,
                             async_scheduling=False,  # (no lookahead: each step is done when `step` returns)
                             speculative_config=spec)
    llm = build_synthetic_llm(preset(args.target), dtype, device, engine_args, draft=preset(args.draft))
    engine, draft = llm.engine, llm.engine.draft
    engine.set_speculation(None)
    seqs = [engine.add_request(list(range(1 + i, args.prompt_len + 1 + i)),
                               SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
            for i in range(args.batch)]
    for _ in range(4):  # the prompts, then a few plain decode steps
        engine.step()
    for seq in seqs:
        assert seq.num_uncomputed_tokens == 1 and not seq.num_pending, "the sequences must be decoding"
        engine.block_manager.append_slot(seq, args.k)  # the slots a proposal's drafts take
    draft.k = args.k
    draft._draft_eager(seqs)  # the draft catches up on the prompts

    def timed(run, missing: int) -> float:
        times = []
        for _ in range(args.reps):
            for seq in seqs:
                seq.num_draft_computed = len(seq.token_ids) - missing
            torch.cuda.synchronize() if device.type == "cuda" else None
            start = time.perf_counter()
            run(seqs).tolist()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    print(f"target {args.target}, draft {args.draft}, k {args.k}, batch {args.batch}, context {len(seqs[0].token_ids)}")
    rows = [("eager path, 1 catch-up row", draft._draft_eager, 1), ("eager path, 2 rows", draft._draft_eager, 2),
            ("k decode steps alone", draft._greedy_steps, 1)]
    if draft.graphs is not None:
        rows[:0] = [("graph, 1 catch-up row", draft._draft, 1), ("graph, 2 catch-up rows", draft._draft, 2)]
    for name, run, missing in rows:
        print(f"{name:28s} {timed(run, missing):7.3f} ms")


if __name__ == "__main__":
    main()
