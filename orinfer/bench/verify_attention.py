"""Verify-attention micro-benchmark: `extend_attention` as the mixed-step graphs call it against `verify_attention`
(kernels/verify_attention.py) on speculative verify steps, at Qwen3.5-27B's heads (24 q / 4 kv x 256) and Qwen3-8B's
(32 / 8 x 128); the flash-decoding kernel beside them when a sequence has one row.

Each case is a graph bucket as engine/step_graphs.py pads it: T = the smallest bucket of 8, 16, 32, 64, 128 holding
batch x rows rows, `--max-seqs` sequences of which `batch` are real (the others empty), fixed_launch=True and
max_query_len=T. Both kernels run every case, whichever paged_attention would pick (it picks verify for T <= 16).
Timing: `--reps` calls captured in one CUDA graph (no launch gaps, as in a step), each over its own copy of the cache
blocks while the copies are small (together >= 128 MiB, so K/V come from HBM as in a step whose weights flush the L2
between layers); the median of `--iters` replays (CUDA events) divided by reps, in us. `kv GB/s`: the context's K and
V bytes over the verify time. `max diff`: the largest |verify - extend| over the real rows (a sanity check).

Run: `python3 -m orinfer.bench.verify_attention [--models qwen3.5-27b,qwen3-8b] [--contexts 512,4096,32768]
[--rows 1,2,3,4,5,8] [--batches 1,8] [--split-tiles 1,2,4] [--fp8] [--json out.json]` (needs a CUDA device; importing
this module does not).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from typing import Callable

import torch

from orinfer.bench.fp8_kernels import replay_us

SHAPES = {"qwen3.5-27b": (24, 4, 256), "qwen3-8b": (32, 8, 128)}  # (q heads, kv heads, head_dim)
BUCKETS = (8, 16, 32, 64, 128)
BLOCK_SIZE = 16
ROTATE_BYTES = 128 << 20


def graph_us(fn: Callable[[int], object], copies: int, reps: int, iters: int) -> float:
    """Median microseconds of one fn(copy) call: reps calls (copy i % copies) captured in a CUDA graph, replayed."""
    return replay_us([functools.partial(fn, i % copies) for i in range(max(reps, copies))], iters)


def bench_case(model: str, batch: int, rows: int, ctx: int, split_tiles: list[int], *, max_seqs: int, reps: int,
               iters: int, fp8: bool, device: torch.device) -> dict:
    """One row of the table: extend, verify (per minimum split length) and, for one row, decode, in us."""
    from orinfer.kernels.decode_attention import paged_decode_attention  # imports triton
    from orinfer.kernels.extend_attention import extend_attention
    from orinfer.kernels.kv_fp8 import KV_FP8_DTYPE
    from orinfer.kernels.verify_attention import verify_attention

    heads, kv_heads, head_dim = SHAPES[model]
    total = batch * rows
    tokens = next(b for b in BUCKETS if b >= total)
    seqs = max(max_seqs, batch)
    width = math.ceil(ctx / BLOCK_SIZE)
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * (1 if fp8 else 2)
    copies = min(reps, max(1, math.ceil(ROTATE_BYTES / kv_bytes)))
    blocks = copies * batch * width
    k_cache = torch.randn(blocks, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    scales: dict = {}
    if fp8:
        k_cache, v_cache = k_cache.to(KV_FP8_DTYPE), v_cache.to(KV_FP8_DTYPE)
        scales = dict(k_scale=torch.ones(kv_heads, device=device), v_scale=torch.ones(kv_heads, device=device))
    tables = torch.zeros(copies, seqs, width, dtype=torch.int32, device=device)
    tables[:, :batch] = torch.randperm(blocks, device=device).to(torch.int32).view(copies, batch, width)
    lens = torch.zeros(seqs, dtype=torch.int32, device=device)
    lens[:batch] = ctx
    starts = torch.full((seqs + 1,), total, dtype=torch.int32, device=device)
    starts[:batch + 1] = torch.arange(0, total + 1, rows, dtype=torch.int32, device=device)
    q = torch.randn(tokens, heads, head_dim, device=device, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    common = dict(max_query_len=tokens, fixed_launch=True, **scales)

    def extend(c: int) -> torch.Tensor:
        return extend_attention(q, k_cache, v_cache, tables[c], lens, starts, scale, **common)

    def verify(split: int) -> Callable[[int], torch.Tensor]:
        return lambda c: verify_attention(q, k_cache, v_cache, tables[c], lens, starts, scale,
                                          min_split_tiles=split, **common)

    row = dict(model=model, batch=batch, rows=rows, ctx=ctx, T=tokens, fp8=fp8,
               extend_us=graph_us(extend, copies, reps, iters))
    for split in split_tiles:
        row[f"verify_us(split>={split})"] = graph_us(verify(split), copies, reps, iters)
    if rows == 1:
        row["decode_us"] = graph_us(lambda c: paged_decode_attention(q[:batch], k_cache, v_cache, tables[c, :batch],
                                                                     lens[:batch], scale, **scales),
                                    copies, reps, iters)
    best = min(row[f"verify_us(split>={s})"] for s in split_tiles)
    row["speedup"] = row["extend_us"] / best
    row["kv_GBps"] = kv_bytes / best / 1e3
    row["max_diff"] = float((verify(split_tiles[0])(0)[:total].float() - extend(0)[:total].float()).abs().max())
    return row


def markdown(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--contexts", type=_ints, default=[512, 4096, 32768])
    parser.add_argument("--rows", type=_ints, default=[1, 2, 3, 4, 5, 8], help="new rows per sequence")
    parser.add_argument("--batches", type=_ints, default=[1, 8])
    parser.add_argument("--split-tiles", type=_ints, default=[1, 2, 4], help="verify's minimum tiles per split")
    parser.add_argument("--max-seqs", type=int, default=64, help="sequences of the padded graph batch")
    parser.add_argument("--reps", type=int, default=32)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--fp8", action="store_true", help="an fp8 (e4m3) KV cache")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    results = []
    for model in args.models.split(","):
        for batch in args.batches:
            for ctx in args.contexts:
                for rows in args.rows:
                    results.append(bench_case(model, batch, rows, ctx, args.split_tiles, max_seqs=args.max_seqs,
                                              reps=args.reps, iters=args.iters, fp8=args.fp8,
                                              device=torch.device("cuda")))
                    torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()}")
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
