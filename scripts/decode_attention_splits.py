"""Paged decode attention at batch 1 (Qwen3-8B heads: 32 q, 8 kv, D 128) against the context length, for several
split counts: the data behind the default split count. Each call is timed inside a CUDA graph (no launch gaps).
Usage (device): python3 scripts/decode_attention_splits.py"""

from __future__ import annotations

import torch
import triton.testing

from orinfer.bench.kernels import _paged_cache
from orinfer.kernels.decode_attention import paged_decode_attention

HEADS, HEAD_DIM = 32, 128


def main() -> None:
    dev = torch.device("cuda")
    splits = [4, 8, 16, 32, 33, 64]
    print("ctx     " + "  ".join(f"splits {s:2d}" for s in splits) + "  (us)")
    for ctx in (256, 1024, 4096, 16384, 32768):
        k_cache, v_cache, tables, lens = _paged_cache(ctx, 1, 16, torch.bfloat16, dev)
        # the engine's graph bounds the context by its max_model_len, not by this sequence: give the table room
        tables = torch.nn.functional.pad(tables, (0, 4096 - tables.shape[1]))
        q = torch.randn(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        torch.cuda.synchronize()  # do_bench_cudagraph runs on a new stream, which does not wait for the inputs
        times = [triton.testing.do_bench_cudagraph(
            lambda s=s: paged_decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, num_splits=s))
            for s in splits]
        print(f"{ctx:6d}  " + "  ".join(f"{t * 1000:9.1f}" for t in times))


if __name__ == "__main__":
    main()
