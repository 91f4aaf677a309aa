"""Can AWQ prefill hide its dequantisation? One Qwen3-8B layer's four projections at 2048 rows, over 8 layers of
random W4 weights: (a) dequantise then cuBLAS, one after the other (what prefill does); (b) the next projection
dequantised on a side stream into one of two reused buffers while cuBLAS runs the current one; (c) cuBLAS alone on
16-bit weights (bf16's prefill: the floor). Then a 2048-token prefill of random AWQ and bf16 Qwen3-8B under the
profiler, CUDA time by kernel. Usage (device): python3 scripts/prefill_overlap.py"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from orinfer.bench.ceilings import time_cuda
from orinfer.bench.engine_bench import build_synthetic_llm
from orinfer.config import EngineConfig, QuantConfig, preset
from orinfer.kernels.w4 import repack_awq
from orinfer.kernels.w4_mma import w4_dequantize
from orinfer.sampling_params import SamplingParams
from w4_sweep import GROUP, SHAPES, random_awq

ROWS, LAYERS = 2048, 8


def main() -> None:
    dev = torch.device("cuda")
    weights = [repack_awq(*random_awq(k, n, dev), GROUP) for _ in range(LAYERS) for k, n, _ in SHAPES.values()]
    xs = {k: torch.randn(ROWS, k, dtype=torch.bfloat16, device=dev) for k, _, _ in SHAPES.values()}
    dense = [w4_dequantize(w) for w in weights[:8]]
    largest = max(w.out_features * w.in_features for w in weights)
    bufs = [torch.empty(largest, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    side = torch.cuda.Stream()

    def serial() -> None:
        for w in weights:
            F.linear(xs[w.in_features], w4_dequantize(w))

    def overlapped() -> None:
        main_stream = torch.cuda.current_stream()
        ready: list[torch.cuda.Event] = []
        freed: list[torch.cuda.Event | None] = [None, None]

        def issue(i: int) -> None:
            w = weights[i]
            if i < 2:                              # the buffer is still unused
                side.wait_stream(main_stream)
            else:                                  # the GEMM that read this buffer two weights ago is done
                side.wait_event(freed[i % 2])
            with torch.cuda.stream(side):
                w4_dequantize(w, out=bufs[i % 2][:w.out_features * w.in_features].view(w.out_features, w.in_features))
                ready.append(torch.cuda.Event())
                ready[-1].record(side)

        issue(0)
        for i, w in enumerate(weights):
            if i + 1 < len(weights):
                issue(i + 1)
            main_stream.wait_event(ready[i])
            F.linear(xs[w.in_features], bufs[i % 2][:w.out_features * w.in_features].view(w.out_features,
                                                                                           w.in_features))
            freed[i % 2] = torch.cuda.Event()
            freed[i % 2].record(main_stream)

    def gemm_only() -> None:
        for i, w in enumerate(weights):
            F.linear(xs[w.in_features], dense[i % 8])   # cold enough: 8 distinct weights, > 800 MB

    def dequant_only() -> None:
        for w in weights:
            w4_dequantize(w)

    for name, fn in (("serial dequant + cuBLAS", serial), ("side-stream dequant", overlapped),
                     ("cuBLAS only (16-bit weights)", gemm_only), ("dequant only", dequant_only)):
        print(f"{name}: {time_cuda(fn, warmup=1, iters=5) / LAYERS * 1e6:.0f} us per layer")
    got = bufs  # the overlapped path's last output equals the serial one
    w = weights[-1]
    assert torch.equal(got[(len(weights) - 1) % 2][:w.out_features * w.in_features].view(w.out_features, w.in_features),
                       w4_dequantize(w))
    del weights, dense, bufs, xs
    torch.cuda.empty_cache()

    ids = torch.randint(100, 150000, (ROWS,)).tolist()
    for quant in (True, False):
        cfg = preset("qwen3-8b")
        if quant:
            cfg.quantization = QuantConfig(group_size=128)
        llm = build_synthetic_llm(cfg, torch.bfloat16, dev, "triton",
                                  EngineConfig(max_num_seqs=1, max_model_len=4096, kv_cache_bytes=1 << 30,
                                               cuda_graph=False))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([ids], params)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([ids], params)
            torch.cuda.synchronize()
        print(f"\n### prefill {ROWS}, {'AWQ' if quant else 'bf16'}\n")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
