"""Why batch-1 decode measures slower inside `orinfer bench` (465 tok/s, run 90) than the graph replays back to back
(2.034 ms -> 492 tok/s): the bench's engine (max_model_len 2064, 64-row graphs) decodes one sequence as the bench
does, with each step's wall time recorded, before and after the bench's prefills, with Python's GC on and off; the
graph replay is timed next to it. Usage (device): python3 scripts/decode_in_bench.py [--quant awq] [--max-len N]"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

from orinfer.bench.engine_bench import _prompts, build_synthetic_llm
from orinfer.config import EngineConfig, QuantConfig, preset
from orinfer.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def decode_b1(llm, vocab: int, steps_log: list[float]) -> float:
    """tok/s as bench_engine computes it (first token to last finish) for one 128-token prompt, 256 tokens."""
    engine = llm.engine
    real_step = engine.step

    def timed_step():
        t = time.perf_counter()
        out = real_step()
        steps_log.append(time.perf_counter() - t)
        return out

    engine.step = timed_step
    try:
        out = llm.generate(_prompts(1, 128, vocab, 101), SamplingParams(max_tokens=256, **GREEDY))[0]
    finally:
        engine.step = real_step
    m = out.metrics
    return (m.num_generated_tokens - 1) / (m.e2e_s - m.ttft_s)


def timed_ms(body, iters: int = 200, warm: int = 0) -> float:
    """Milliseconds per call of `body` (queued back to back, the device synchronised around them), after `warm`
    untimed calls."""
    for _ in range(warm):
        body()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        body()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1000


def replay_ms(llm) -> float:
    """The engine's batch-1 graph, replayed back to back."""
    return timed_ms(llm.engine.runner.graphs.graph_for(1, 1)[0].replay)  # what a short-context step replays


def replays(llm, times: int = 3) -> str:
    """`replay_ms` a few times, as "a / b / c" (they agree to ~0.002 ms within one engine)."""
    return " / ".join(f"{replay_ms(llm):.3f}" for _ in range(times))


def warm_decode(llm) -> None:
    """One 128-token prompt decoding 32 tokens: leaves the batch-1 graph's inputs at a ~160-token context."""
    llm.generate(_prompts(1, 128, llm.engine.parts.model_config.vocab_size, 0),
                 SamplingParams(max_tokens=32, **GREEDY))


def awq_engine(ecfg: EngineConfig):
    """An LLM over random Qwen3-8B AWQ weights with this engine configuration, after `warm_decode`."""
    cfg = preset("qwen3-8b")
    cfg.quantization = QuantConfig(group_size=128)
    llm = build_synthetic_llm(cfg, torch.bfloat16, torch.device("cuda"), "triton", ecfg)
    warm_decode(llm)
    return llm


def report(label: str, tok_s: float, steps: list[float]) -> None:
    ms = sorted(s * 1000 for s in steps[2:])
    print(f"{label}: {tok_s:.1f} tok/s; engine.step wall ms p10 {ms[len(ms) // 10]:.3f} median "
          f"{statistics.median(ms):.3f} p90 {ms[9 * len(ms) // 10]:.3f} max {ms[-1]:.3f} (n={len(ms)})")


def main() -> None:
    cfg = preset("qwen3-8b")
    if "--quant" in sys.argv and sys.argv[sys.argv.index("--quant") + 1] == "awq":
        cfg.quantization = QuantConfig(group_size=128)
    max_len = int(sys.argv[sys.argv.index("--max-len") + 1]) if "--max-len" in sys.argv else 2064
    seq_tokens = 128 + 256
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.kv_size * 2 * 64 * (seq_tokens + 32)
    ecfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=max_len,
                        kv_cache_bytes=max(kv_bytes, 2 * max_len * 2**20))
    llm = build_synthetic_llm(cfg, torch.bfloat16, torch.device("cuda"), "triton", ecfg)
    llm.generate(_prompts(1, 64, cfg.vocab_size, 0), SamplingParams(max_tokens=8, **GREEDY))
    for label in ("fresh", "fresh again"):
        steps: list[float] = []
        report(label, decode_b1(llm, cfg.vocab_size, steps), steps)
    print(f"graph replay {replay_ms(llm):.3f} ms")
    for length in (512, 2048):
        if length + 2 <= max_len:
            for r in range(4):
                llm.generate(_prompts(1, length, cfg.vocab_size, r), SamplingParams(max_tokens=1, **GREEDY))
    for label in ("after prefills", "after prefills again"):
        steps = []
        report(label, decode_b1(llm, cfg.vocab_size, steps), steps)
    gc.disable()
    steps = []
    report("gc off", decode_b1(llm, cfg.vocab_size, steps), steps)
    gc.enable()
    print(f"graph replay {replay_ms(llm):.3f} ms")


if __name__ == "__main__":
    main()
