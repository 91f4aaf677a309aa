"""Where a batch-1 decode step's time goes: GPU time of the captured graph (replayed back to back) against the wall
time of a full engine step (scheduling, input upload, replay, sampling, the one host sync, bookkeeping).
Usage (device): python3 scripts/decode_overhead.py [--quant awq]"""

from __future__ import annotations

import sys
import time

import torch

from orinfer.bench.engine_bench import build_synthetic_llm
from orinfer.config import EngineConfig, QuantConfig, preset
from orinfer.sampling_params import SamplingParams


def main() -> None:
    cfg = preset("qwen3-8b")
    if "--quant" in sys.argv and sys.argv[sys.argv.index("--quant") + 1] == "awq":  # random packed AWQ weights
        cfg.quantization = QuantConfig(group_size=128)
    dev = torch.device("cuda")
    llm = build_synthetic_llm(cfg, torch.bfloat16, dev, "triton",
                              EngineConfig(max_num_seqs=1, max_model_len=2048, kv_cache_bytes=1 << 30))
    engine, runner = llm.engine, llm.engine.runner
    llm.generate([list(range(1000, 1128))], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    seq = engine.add_request(list(range(2000, 2128)), SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    step_ms = (time.perf_counter() - t) / n * 1000

    graph, _ = runner.graphs.graph_for(1, seq.num_tokens)  # the graph the steps above replayed
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - t) / n * 1000

    seqs = [seq]
    t = time.perf_counter()
    for _ in range(n):
        runner.prepare(seqs, False)
    prepare_ms = (time.perf_counter() - t) / n * 1000
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        runner.sampling_batch(seqs)
    sampling_ms = (time.perf_counter() - t) / n * 1000
    t = time.perf_counter()
    for _ in range(n):
        engine.scheduler.schedule()
    schedule_ms = (time.perf_counter() - t) / n * 1000
    engine.abort(seq.request_id)
    print(f"engine step (wall): {step_ms:.3f} ms -> {1000 / step_ms:.1f} tok/s")
    print(f"graph replay only (GPU): {replay_ms:.3f} ms -> {1000 / replay_ms:.1f} tok/s")
    print(f"host parts: prepare {prepare_ms * 1000:.0f} us, sampling batch {sampling_ms * 1000:.0f} us, "
          f"schedule {schedule_ms * 1000:.0f} us")


if __name__ == "__main__":
    main()
