"""The batch-1 AWQ decode graph's replay time under different engine configurations, one engine at a time in one
process: which of max_num_seqs (graph buckets sharing one memory pool), the KV-cache size or max_model_len (the
decode attention's split count) makes the bench's graph (2.126 ms, run 91) slower than decode_overhead.py's (2.034).
Usage (device): python3 scripts/decode_graph_variants.py [SEQS,KV,MAX_LEN[,BATCHED] ...] (default: the list below, in
order); KV is GiB of cache budget, or a block count when it ends in "b"; BATCHED is max_num_batched_tokens (8192),
which with SEQS sizes the eager warm-up prefill the KV budget is measured after (min(BATCHED, SEQS * MAX_LEN) tokens;
none when KV is a block count). PRE_MATMUL=1: one cuBLAS matmul before the engine is built (does initialising cuBLAS
first change the graph?)."""

from __future__ import annotations

import gc
import os
import sys

import torch

from decode_in_bench import awq_engine, replays  # same folder
from orinfer.config import EngineConfig

VARIANTS = [  # (max_num_seqs, KV-cache bytes, max_model_len)
    (1, 1 << 30, 2048), (64, 1 << 30, 2064), (1, 4 << 30, 2064), (64, 4 << 30, 2064), (64, 4 << 30, 400),
    (1, 1 << 30, 2048)]


def main() -> None:
    if os.environ.get("PRE_MATMUL") == "1":
        a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
        (a @ a.t()).sum().item()
    variants = [a.split(",") + ["8192"] for a in sys.argv[1:]]
    variants = [(int(s), kv if kv.endswith("b") else int(kv) << 30, int(n), int(b))
                for s, kv, n, b, *_ in variants] or [v + (8192,) for v in VARIANTS]
    for seqs, kv, max_len, batched in variants:
        kv_arg = {"num_kv_blocks": int(kv[:-1])} if isinstance(kv, str) else {"kv_cache_bytes": kv}
        llm = awq_engine(EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=batched, max_model_len=max_len,
                                      **kv_arg))
        blocks = llm.engine.runner.num_blocks
        print(f"max_num_seqs {seqs:3d}, KV {blocks} blocks, max_model_len {max_len}, max_num_batched_tokens "
              f"{batched}: replay {replays(llm)} ms")
        del llm
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
