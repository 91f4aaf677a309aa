"""Where a batch-1 AWQ decode step's time goes between kernels, in the bench's engine (max_num_seqs 64) or a
1-sequence one: a torch.profiler trace of one sequence decoding; then one step boundary (GPU operations and the host's
CUDA calls, lm_head to the next step's first norm), and over the steady-state steps, per kernel (and grid) the summed
duration and start -> next start, and the idle gaps by the kernel pair around them (under PDL a kernel starts before
its predecessor ends, so busy time can exceed the step). Usage (device):
python3 scripts/decode_gaps.py [SEQS] [OUT_DIR]   (SEQS: max_num_seqs, default 64)"""

from __future__ import annotations

import collections
import json
import sys

from torch.profiler import ProfilerActivity, profile

from decode_in_bench import GREEDY, awq_engine
from orinfer.bench.engine_bench import _prompts
from orinfer.config import EngineConfig
from orinfer.sampling_params import SamplingParams

STEPS = 48


def events_of(trace_path: str, cats: tuple[str, ...]) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of a chrome trace's events of these categories, in start order."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    def name(e: dict) -> str:   # kernels of one name told apart by their grid (the GEMVs' projections)
        grid = e.get("args", {}).get("grid")
        return f"{e['name'][:40]} {grid}" if grid and e.get("cat") == "kernel" else e["name"]
    return sorted((e["ts"], e["ts"] + e["dur"], name(e)) for e in events if e.get("cat") in cats and "dur" in e)


def kernels_of(trace_path: str) -> list[tuple[float, float, str]]:
    """Every GPU kernel and memcpy/memset."""
    return events_of(trace_path, ("kernel", "gpu_memcpy", "gpu_memset"))


def show_boundary(ks: list, calls: list, begin: int, end: int) -> None:
    """The GPU operations from ks[begin] to ks[end] and the host's CUDA runtime calls in that time, merged in time
    order (relative to ks[begin]'s start)."""
    t0 = ks[begin][0]
    rows = [(s, e, "GPU ", n) for s, e, n in ks[begin:end + 1]]
    rows += [(s, e, "host", n) for s, e, n in calls if t0 - 50 <= s <= ks[end][1]]
    for s, e, who, n in sorted(rows):
        print(f"    {s - t0:9.1f} .. {e - t0:9.1f}  {who}  {n[:70]}")


def main() -> None:
    seqs = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    out_dir = sys.argv[2] if len(sys.argv) > 2 else "/tmp"
    max_len = 2064
    ecfg = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=8192, max_model_len=max_len,
                        kv_cache_bytes=2 * max_len * 2**20 if seqs == 1 else 4 << 30)
    llm = awq_engine(ecfg)
    vocab = llm.engine.parts.model_config.vocab_size
    params = SamplingParams(max_tokens=STEPS + 16, **GREEDY)
    llm.generate(_prompts(1, 128, vocab, 7), params)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        out = llm.generate(_prompts(1, 128, vocab, 8), params)[0]
    m = out.metrics
    print(f"max_num_seqs {seqs}: {(m.num_generated_tokens - 1) / (m.e2e_s - m.ttft_s):.1f} tok/s in the profiled run")
    path = f"{out_dir}/decode_gaps_{seqs}.json"
    prof.export_chrome_trace(path)
    ks = kernels_of(path)
    # Steps are split at the lm_head's bf16 GEMV, the one kernel of its name and grid launched once per step.
    first = collections.Counter(name for _, _, name in ks)
    per_step = [n for n, c in first.items() if STEPS <= c <= STEPS + 40 and "indexSelect" not in n]
    print("kernels seen about once per step:", {n[:60]: first[n] for n in per_step})
    marker = next(n for n in per_step if n.startswith("_gemv_kernel"))   # the lm_head, once per step
    starts = [i for i, k in enumerate(ks) if k[2] == marker]
    window = starts[8:-4]
    busy, span, gaps = 0.0, 0.0, collections.Counter()
    gap_n = collections.Counter()
    for a, b in zip(window, window[1:]):
        step = ks[a:b]
        span += ks[b][0] - step[0][0]
        busy += sum(e - s for s, e, _ in step)
        for (s0, e0, n0), (s1, _, n1) in zip(step, step[1:] + [ks[b]]):
            if s1 - e0 > 0:
                key = (n0[:50], n1[:50])
                gaps[key] += s1 - e0
                gap_n[key] += 1
    calls = events_of(path, ("cuda_runtime", "cuda_driver"))
    for a in window[10:11]:   # a step's boundary: the lm_head GEMV (the marker) to the next step's first norm
        nxt = next(i for i in range(a + 1, len(ks)) if "norm" in ks[i][2])
        print(f"  boundary at step start {a}:")
        show_boundary(ks, calls, a, nxt)
    n = len(window) - 1
    print(f"{n} steps (split at {marker[:60]}): step {span / n:.1f} us, kernels busy {busy / n:.1f} us, "
          f"idle {(span - busy) / n:.1f} us per step")
    dur, lead = collections.Counter(), collections.Counter()   # per name: summed duration, start -> next start
    count = collections.Counter()
    for a, b in zip(window, window[1:]):
        for (s0, e0, n0), (s1, _, _) in zip(ks[a:b], ks[a + 1:b + 1]):
            dur[n0[:50]] += e0 - s0
            lead[n0[:50]] += s1 - s0
            count[n0[:50]] += 1
    print("per step, by kernel: count, summed duration, summed start -> next start (us):")
    for name, t in lead.most_common(14):
        print(f"  {count[name] / n:6.1f}  {dur[name] / n:8.1f}  {t / n:8.1f}  {name}")
    print("largest idle time per step by (kernel before, kernel after):")
    for (a, b), t in gaps.most_common(12):
        print(f"  {t / n:8.2f} us  x{gap_n[(a, b)] / n:5.1f}  {a}  ->  {b}")


if __name__ == "__main__":
    main()
