"""A tile sweep of the paged decode attention (`paged_decode_attention`, kernels/decode_attention.py) at serving shapes.

For each (batch, context) case (`--cases B:CTX,...`; every sequence holds CTX tokens) at a model's heads (`--preset`,
Qwen3-8B: 32 q heads, 8 kv heads of 128), over a bf16 cache of 16-token blocks scattered at random (with `--fp8` the
e4m3 cache with its per-head scales too), it times the default launch (`default_tile`, the default split rule) and
every candidate of `candidates`: block_n 32/64/128 x stages 2/3/4 x warps 4/8, each with num_splits 1, 2 and 4 when
batch x kv heads programs already cover the SMs (large batch), with the default split rule otherwise. A candidate
that does not compile or fit (shared memory, registers) is reported with its error instead of a time.

Timing as bench/verify_attention.py: `--reps` calls captured in one CUDA graph (no launch gaps, as in a step), each
call over its own layer's cache while 4 x L2 bytes of them fit (the caches of `copies` layers, rotated call after
call), so the K/V come from HBM as they do in a step whose weights flush the L2 between layers; the median of `--iters`
replays per call, in us per layer. Bytes: the K and V read, 2 * B * CTX * Hk * D * (2 bytes; 1 in fp8), over the time
as GB/s and as a share of the read bandwidth measured in the same run (`read_bandwidth_gbps`). Per case: the best
candidate and its speedup over the default; `max diff` is the largest |candidate - default| output (a sanity check).

Run: `python -m orinfer.bench.decode_attention_sweep [--preset qwen3-8b] [--cases 64:528,64:1024] [--fp8] [--iters 20]
[--reps 32] [--tensor-parallel-size N] [--out DIR] [--json FILE]` (needs a CUDA device; importing this module does
not); --out writes DIR/decode-attention-sweep.md and DIR/decode-attention-sweep.json.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from orinfer.bench.kernels import _paged_cache, markdown, read_bandwidth_gbps, report
from orinfer.bench.verify_attention import graph_us
from orinfer.config import preset

DEFAULT_CASES = ((1, 4096), (1, 32768), (8, 2048), (32, 1024), (64, 256), (64, 528), (64, 1024), (64, 2048))
BLOCK_SIZE = 16
TILE_AXES = ((32, 64, 128), (2, 3, 4), (4, 8))  # block_n, stages, warps
LARGE_BATCH_SPLITS = (1, 2, 4)


def tiles() -> list:
    """Every DecodeTile of the sweep (TILE_AXES' product)."""
    from orinfer.kernels.decode_attention import DecodeTile  # imports triton

    return [DecodeTile(n, s, w) for n in TILE_AXES[0] for s in TILE_AXES[1] for w in TILE_AXES[2]]


def candidates(batch: int, kv_heads: int, sms: int) -> list[tuple[object, int | None]]:
    """(tile, num_splits) pairs timed for a case: every tile with splits 1, 2, 4 when batch x kv_heads programs
    cover the `sms` SMs; with None (the default split rule, which counts the tile's own tiles) otherwise."""
    splits = LARGE_BATCH_SPLITS if batch * kv_heads >= sms else (None,)
    return [(tile, s) for tile in tiles() for s in splits]


def tile_label(tile, splits: int) -> str:
    return f"n{tile.block_n} s{tile.stages} w{tile.warps} x{splits} splits"


def l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0


def sweep_case(batch: int, ctx: int, heads: tuple[int, int, int], *, fp8: bool, device: torch.device, iters: int,
               reps: int, read_gbps: float, pairs: list | None = None) -> list[dict]:
    """The default's row then one row per candidate (`pairs`, default `candidates(...)`) for one case, in
    bench/kernels.py's row format (op, shape, impl, us, bytes, GBps, pct_read_bw, speedup over the default, config)
    plus batch, ctx, cache, max_diff and `tags` (default, best)."""
    from orinfer.kernels.attention import num_sms
    from orinfer.kernels.decode_attention import default_num_splits, default_tile, paged_decode_attention
    from orinfer.kernels.kv_fp8 import KV_FP8_DTYPE

    n_heads, kv_heads, head_dim = heads
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * (1 if fp8 else 2)
    copies = max(1, math.ceil(4 * l2_bytes(device) / kv_bytes))  # layers' caches: 4 x L2 bytes in all
    k_cache, v_cache, tables, lens = _paged_cache(ctx, batch * copies, BLOCK_SIZE, torch.bfloat16, device,
                                                  kv_heads, head_dim)
    tables, lens = tables.view(copies, batch, -1), lens[:batch]
    scales: dict = {}
    if fp8:
        k_cache, v_cache = k_cache.to(KV_FP8_DTYPE), v_cache.to(KV_FP8_DTYPE)
        scales = dict(k_scale=torch.full((kv_heads,), 0.5, device=device),
                      v_scale=torch.full((kv_heads,), 0.5, device=device))
    q = torch.randn(batch, n_heads, head_dim, device=device, dtype=torch.bfloat16)

    def call(tile, splits):
        return lambda c: paged_decode_attention(q, k_cache, v_cache, tables[c], lens, head_dim ** -0.5, splits,
                                                tile=tile, **scales)

    def resolved_splits(tile, splits: int | None) -> int:
        if splits is not None:
            return splits
        max_tiles = max(1, math.ceil(tables.shape[2] * BLOCK_SIZE / tile.block_n))
        return default_num_splits(batch, kv_heads, max_tiles, device)

    default = default_tile(head_dim, fp8, dot_f32=False, programs=batch * kv_heads, sms=num_sms(device))
    want = call(None, None)(0).float()
    shape = f"B={batch} ctx={ctx} Hq={n_heads} Hk={kv_heads} D={head_dim} {'fp8' if fp8 else 'bf16'}"
    rows = []
    for tile, splits in [(None, None)] + (pairs if pairs is not None else candidates(batch, kv_heads, num_sms(device))):
        label = tile_label(tile or default, resolved_splits(tile or default, splits))
        row = dict(op="paged decode attention", shape=shape, impl="triton", batch=batch, ctx=ctx,
                   cache="fp8" if fp8 else "bf16", bytes=kv_bytes, tags=["default"] if tile is None else [])
        try:
            us = graph_us(call(tile, splits), copies, reps, iters)
        except Exception as e:  # a tile that does not compile or fit is reported, not fatal (the default must run)
            if tile is None:
                raise
            rows.append({**row, "us": None, "config": f"{label} failed: {type(e).__name__}: {str(e)[:80]}"})
            continue
        diff = float((call(tile, splits)(0).float() - want).abs().max())
        rows.append({**row, "us": us, "GBps": kv_bytes / us / 1e3, "speedup": rows[0]["us"] / us if rows else 1.0,
                     "pct_read_bw": 100.0 * kv_bytes / us / 1e3 / read_gbps, "max_diff": diff,
                     "config": label if tile is None else f"{label} (max diff {diff:.2g})"})
    timed = sorted((r for r in rows[1:] if r["us"] is not None), key=lambda r: r["us"])
    (timed[0] if timed and timed[0]["us"] < rows[0]["us"] else rows[0])["tags"].append("best")
    for r in rows:
        r["config"] = (f"**{', '.join(r['tags'])}** " if r["tags"] else "") + r["config"]
    del k_cache, v_cache
    return [rows[0]] + timed + [r for r in rows[1:] if r["us"] is None]


def summary(rows: list[dict]) -> str:
    """One line per case: the default and the best candidate, as us, GB/s (% of the read bandwidth), speedup."""
    lines = ["| case | default | us | GB/s (% read BW) | best | us | GB/s (% read BW) | speedup |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        if "default" not in r.get("tags", ()) or r["us"] is None:
            continue
        best = next(b for b in rows if b.get("shape") == r["shape"] and "best" in b.get("tags", ()))
        lines.append(f"| {r['shape']} | {r['config'].split('** ')[-1]} | {r['us']:.1f} | {r['GBps']:.0f} "
                     f"({r['pct_read_bw']:.1f}%) | {best['config'].split('** ')[-1]} | {best['us']:.1f} | "
                     f"{best['GBps']:.0f} ({best['pct_read_bw']:.1f}%) | {r['us'] / best['us']:.3f}x |")
    return "\n".join(lines)


def run_sweep(cases: list[tuple[int, int]], heads: tuple[int, int, int], *, fp8_too: bool = False,
              device: str = "cuda", iters: int = 20, reps: int = 32, pairs: list | None = None) -> list[dict]:
    """The read-bandwidth row, then `sweep_case`'s rows for each case (bf16 cache, and fp8 with `fp8_too`)."""
    dev = torch.device(device)
    torch.manual_seed(0)
    read_gbps = read_bandwidth_gbps(dev)
    rows = [{"op": "read bandwidth (x.sum, 4 GiB fp32)", "shape": "", "impl": "torch", "us": None,
             "bytes": 4 * 2**30, "GBps": read_gbps, "pct_read_bw": 100.0}]
    for fp8 in (False, True) if fp8_too else (False,):
        for batch, ctx in cases:
            rows += sweep_case(batch, ctx, heads, fp8=fp8, device=dev, iters=iters, reps=reps, read_gbps=read_gbps,
                               pairs=pairs)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"64:528,1:4096" -> [(64, 528), (1, 4096)] (batch, context), each >= 1."""
    cases = []
    for item in filter(None, text.split(",")):
        batch, sep, ctx = item.partition(":")
        if not (sep and batch.isdigit() and ctx.isdigit() and int(batch) > 0 and int(ctx) > 0):
            raise ValueError(f"a case is BATCH:CONTEXT with both >= 1, not {item!r}")
        cases.append((int(batch), int(ctx)))
    return cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="qwen3-8b", help="whose attention heads (an orinfer bench --synthetic name)")
    p.add_argument("--cases", default=",".join(f"{b}:{c}" for b, c in DEFAULT_CASES),
                   help="comma-separated BATCH:CONTEXT pairs")
    p.add_argument("--fp8", action="store_true", help="also the fp8 (e4m3) cache with its per-head scales")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="one rank's heads under N-way tensor parallelism (kv heads replicated below N)")
    p.add_argument("--iters", type=int, default=20, help="graph replays per candidate (median)")
    p.add_argument("--reps", type=int, default=32, help="calls per CUDA graph")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--out", help="also write decode-attention-sweep.md and .json in this folder")
    args = p.parse_args(argv)
    try:
        cases = parse_cases(args.cases)
    except ValueError as e:
        p.error(str(e))
    if not cases:
        p.error("--cases is empty")
    cfg = preset(args.preset)
    tp = args.tensor_parallel_size
    heads = (cfg.num_attention_heads // tp, max(1, cfg.num_key_value_heads // tp), cfg.head_dim)
    if not torch.cuda.is_available():
        print("the decode attention sweep needs a CUDA device")
        return 1
    rows = run_sweep(cases, heads, fp8_too=args.fp8, device=args.device, iters=args.iters, reps=args.reps)
    out = (lambda ext: os.path.join(args.out, f"decode-attention-sweep.{ext}")) if args.out else (lambda ext: None)
    table = (summary(rows) + "\n\nEvery candidate, the default first, then fastest first per case:\n\n"
             + markdown(rows, speedup="speedup vs default"))
    model = args.preset + (f" TP{tp}" if tp > 1 else "")
    report(rows, table, f"Paged decode attention tiles on {{device}} ({model}: Hq {heads[0]}, Hk {heads[1]}, "
           f"D {heads[2]}; block size {BLOCK_SIZE}; {args.reps} calls a graph; torch {torch.__version__})",
           args.device, args.json or out("json"), out("md"), torch=torch.__version__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
