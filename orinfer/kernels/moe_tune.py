"""Times the MoE kernel configs for one expert shape on this GPU and writes the table `fused_moe` then loads.

    python -m orinfer.kernels.moe_tune --preset qwen3-30b-a3b
    python -m orinfer.kernels.moe_tune --experts 128 --hidden 2048 --inter 768 --top-k 8 \\
        [--tokens 1,2,4,8,16,32,64,128,256,512,1024,2048,4096] [--dtype bfloat16|float16|float8_e4m3fn|w4] \\
        [--shared-slot] [--out DIR] [--quick]

For each token count T: random routing (`moe_route` of normal logits: every expert about equally loaded; with
--shared-slot the experts also hold a folded shared expert, layers/moe.py: E + 1 slots, every token's (k+1)-th pair
in the last, and the table is named for E + 1 and k + 1), then every candidate of each stage is timed alone, giving one config per path and row block:
  decode (T <= 16): the up kernel per tile (block_m 1, the FMA loop, only at T = 1; block_m 16, tensor cores), the
                    down kernel per (tile, split), the split's sum included;
  grouped:          per block_m, the up GEMM per tile and the down GEMM per tile;
  FP8 at T = 1:     only the gemv path (`moe_fp8_decode`, which `fused_moe_fp8` runs for one token with 16-bit x
                    whatever the table says): the up kernel per tile, then the down kernel per tile;
  gemv (16-bit, T = 1): the gemv path of bf16 / fp16 experts (`moe_gemv16`) beside decode and grouped, likewise; it
                    and its default config join the whole-call race (`gemv_candidates` lists the stage tiles).
Those configs and the default are then timed as whole `fused_moe` calls, and the fastest call wins: a sum of stages
timed apart (each with its own cold L2 and launch) misranked them (run 306: tables slower than the default at 32-128
tokens), and the whole call is what a step runs. 4-bit experts (--dtype w4: AWQ / GPTQ-Int4 in groups of 128) have
no per-stage entry points, so all their candidates are whole calls (`tune_tokens_w4`). FP8 experts from
`moe_a8.MIN_TOKENS` tokens also get their W8A8 kernels' tiles tuned, as whole calls (`tune_tokens_a8`), into a table
of their own (label W8A8_LABEL), which `fused_moe_fp8` reads for the calls it sends to those kernels.
Timing: CUDA-graph replays of the call over BANKS copies of the weights in turn (`_time`: no launch overhead, and the
weights come from HBM as they do in a decode step). A candidate that does not compile or fit (shared memory,
registers) is skipped. The table goes
to orinfer/kernels/moe_configs/ (or --out), named and laid out as `kernels/moe_config.py` documents; each entry
keeps its measured microseconds ("us") and the defaults' ("default_us") for comparison. A table that exists already
keeps its entries for the token counts not tuned again, so a preset can be tuned in parts (--tokens 1,2,4,8,16, then
the rest). Without --quick a full preset takes several minutes (much of it compiling).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch

from orinfer.kernels.fp8_block import FP8_DTYPE
from orinfer.kernels.moe_fp8 import expert_scale_shapes
from orinfer.kernels.moe_config import (A8, DECODE_MAX_TOKENS, GEMV, GROUPED_BLOCK_M, TABLE_DIR, W8A8_LABEL,
                                        MoeConfig, Tile, config_to_json, default_config, load_table, table_name,
                                        w4_label)

PRESETS = {"qwen3-30b-a3b": (128, 2048, 768, 8), "qwen3.5-35b-a3b": (256, 2048, 512, 8)}


def routing(tokens: int, experts: int, top_k: int, device: torch.device, shared_slot: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing calls are timed on: `moe_route` of normal logits over the experts; `shared_slot`: the last of
    them is a folded shared expert, every token's k-th pair after the top-(k-1) of the others."""
    from orinfer.kernels.moe_ops import moe_route

    if shared_slot:
        return moe_route(torch.randn(tokens, experts - 1, device=device), top_k - 1, True,
                         shared_logit=torch.randn(tokens, 1, device=device))
    return moe_route(torch.randn(tokens, experts, device=device), top_k, True)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# (block_n, block_k, num_warps, num_stages). FMA: one token, a [block_n, block_k] fp32 tile per weight (two for
# gate/up) in registers, no pipelining (num_stages 1).
FMA_UP = [Tile(4, 512, 4, 1), Tile(2, 1024, 4, 1), Tile(8, 256, 4, 1), Tile(4, 1024, 4, 1), Tile(8, 512, 8, 1),
          Tile(2, 2048, 4, 1), Tile(16, 256, 8, 1), Tile(2, 512, 2, 1)]
FMA_DOWN = [Tile(2, 256, 2, 1), Tile(4, 256, 4, 1), Tile(2, 512, 4, 1), Tile(4, 512, 4, 1), Tile(8, 256, 4, 1),
            Tile(1, 1024, 4, 1), Tile(2, 1024, 4, 1), Tile(1, 512, 2, 1)]
# Decode on tensor cores: 64 or 128 weight rows per tile map onto Hopper's wgmma (the tokens are its N = 16).
DOT_DECODE = [Tile(64, 128, 4, 3), Tile(64, 64, 4, 4), Tile(64, 256, 4, 2), Tile(128, 64, 4, 3),
              Tile(128, 128, 8, 3), Tile(32, 128, 4, 3)]
# FP8 experts (block-wise scales, bk = 128): tensor-core K steps stay inside one scale column (`_fp8_tiles`); one
# token takes the gemv path and its candidates (`moe_fp8_decode.UP_CANDIDATES`, `DOWN_CANDIDATES`).
FP8_BLOCK = (128, 128)
# 4-bit experts (AWQ, GPTQ-Int4) in groups of W4_GROUP: a K step is one W4 chunk of 128 inputs, and a program's
# unpacked tile stays within `moe_w4.UNPACKED_LIMIT` (32 rows on the decode path, 64 grouped).
W4_GROUP = 128
FMA_W4 = [Tile(4, 128, 2, 1), Tile(8, 128, 2, 1), Tile(8, 128, 4, 1), Tile(16, 128, 4, 1), Tile(16, 128, 8, 1),
          Tile(32, 128, 4, 1), Tile(32, 128, 8, 1)]
DOT_W4 = [Tile(16, 128, 4, 3), Tile(32, 128, 4, 3), Tile(32, 128, 8, 3), Tile(32, 128, 4, 2)]
GROUPED_W4 = [Tile(32, 128, 4, 3), Tile(64, 128, 4, 3), Tile(64, 128, 8, 3), Tile(64, 128, 4, 2), Tile(16, 128, 4, 3)]
SPLITS_FMA = (1, 2, 4, 8)
SPLITS_DOT = (1, 2, 4, 8, 16)
GROUPED = [Tile(64, 64, 4, 3), Tile(64, 64, 4, 4), Tile(128, 64, 4, 3), Tile(128, 64, 8, 3), Tile(64, 128, 4, 3),
           Tile(128, 128, 8, 3), Tile(256, 64, 8, 3), Tile(32, 64, 4, 4)]


BANKS = 3    # weight copies a timing graph cycles through: each call reads its experts from HBM, not from L2
REPEAT = 4   # rounds over the banks per replay


def _time(fn: Callable[[torch.Tensor, torch.Tensor], object], banks: list[tuple[torch.Tensor, torch.Tensor]]
          ) -> float:
    """Median microseconds of one fn(w13, w2) call; inf when it does not compile or run. The calls are replayed from
    a CUDA graph, one per weight bank in turn, as a decode step's layers run: no launch overhead is timed (eager
    timing of a one-token call measured the host: its ranks were noise), and no call finds its weights in L2."""
    try:
        for w13, w2 in banks:
            fn(w13, w2)                                          # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(REPEAT):
                for w13, w2 in banks:
                    fn(w13, w2)
    except Exception:  # out of shared memory / registers, or an invalid tile
        return float("inf")
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] * 1000.0 / (REPEAT * len(banks))


def _best(timings: dict) -> tuple[object, float]:
    key = min(timings, key=timings.get)
    return key, timings[key]


def tune_tokens(tokens: int, banks: list[tuple[torch.Tensor, torch.Tensor]], top_k: int, quick: bool = False,
                scales: tuple[torch.Tensor, torch.Tensor] | None = None, shared_slot: bool = False
                ) -> tuple[MoeConfig, float, float]:
    """(the fastest config, its us, the default config's us) for one token count; banks: copies of (w13, w2);
    scales: (s13, s2) when the weights are FP8 (in FP8_BLOCK blocks; one set serves every bank); shared_slot: the
    last expert is a folded shared expert (`routing`)."""
    from orinfer.kernels import moe_decode, moe_gemm
    from orinfer.kernels.moe_align import moe_align
    from orinfer.kernels.moe_fp8 import fp8_config
    from orinfer.kernels.moe_ops import fused_moe, fused_moe_fp8

    w13, w2 = banks[0]
    experts, _, hidden = w13.shape
    dev = w13.device
    dtype = torch.bfloat16 if scales is not None else w13.dtype
    s13, s2 = scales if scales is not None else (None, None)
    block = FP8_BLOCK if scales is not None else None
    x = torch.randn(tokens, hidden, device=dev).to(dtype)
    weights, ids = routing(tokens, experts, top_k, dev, shared_slot)
    few = (lambda c: c[:2]) if quick else (lambda c: c)
    if scales is not None and tokens == 1:
        return _tune_gemv(x, weights, ids, banks, scales, few)
    candidates: list[MoeConfig] = []
    if gemv_candidates(tokens, w13.dtype) is not None:                 # 16-bit experts at T = 1
        from orinfer.kernels.moe_gemv16 import default_gemv16_config

        candidates += [_gemv_stages(x, weights, ids, banks, None, few), default_gemv16_config(top_k, w2.shape[2])]
    if tokens <= DECODE_MAX_TOKENS:
        for block_m in ((1, 16) if tokens == 1 else (16,)):
            ups, downs = (FMA_UP, FMA_DOWN) if block_m == 1 else (DOT_DECODE, DOT_DECODE)
            if scales is not None:
                ups = downs = _fp8_tiles(DOT_DECODE)                    # T = 1: `_tune_gemv`
            splits = SPLITS_FMA if block_m == 1 else SPLITS_DOT
            up, _ = _best({t: _time(lambda a, b, t=t: moe_decode.decode_up(x, a, ids, block_m, t, s13, block), banks)
                           for t in few(ups)})
            h = moe_decode.decode_up(x, w13, ids, block_m, up, s13, block)
            down_t = {(t, s): _time(lambda a, b, t=t, s=s: moe_decode.decode_down(h, b, weights, ids, block_m, t, s,
                                                                                 s2, block), banks)
                      for t in few(downs) for s in few(splits) if s <= tokens * top_k}
            (down, split), _ = _best(down_t)
            candidates.append(MoeConfig("decode", block_m, up, down, split))
    rows = tokens * top_k / experts
    grouped = GROUPED if scales is None else _fp8_tiles(GROUPED)
    for block_m in GROUPED_BLOCK_M:
        if (block_m > 16 and rows < block_m / 4) or (quick and block_m > 32):
            continue
        align = moe_align(ids, experts, block_m)
        up, _ = _best({t: _time(lambda a, b, t=t: moe_gemm.grouped_up(x, a, align, top_k, t, s13, block), banks)
                       for t in few(grouped)})
        h = moe_gemm.grouped_up(x, w13, align, top_k, up, s13, block)
        down, _ = _best({t: _time(lambda a, b, t=t: moe_gemm.grouped_down(h, b, align, tokens * top_k, t, s2, block),
                                  banks) for t in few(grouped)})
        candidates.append(MoeConfig("grouped", block_m, up, down))
    default = default_config(tokens, experts, top_k, wide=False)
    if scales is None:
        def call(a: torch.Tensor, b: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
            return fused_moe(x, a, b, weights, ids, config=cfg)
    else:
        default = fp8_config(default, FP8_BLOCK[1])
        def call(a: torch.Tensor, b: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
            return fused_moe_fp8(x, a, s13, b, s2, FP8_BLOCK, weights, ids, config=cfg)
    whole = {cfg: _time(lambda a, b, cfg=cfg: call(a, b, cfg), banks) for cfg in dict.fromkeys([*candidates, default])}
    best, best_us = _best(whole)
    return best, best_us, whole[default]


def _tune_gemv(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, banks: list, scales: tuple,
               few: Callable[[list], list]) -> tuple[MoeConfig, float, float]:
    """`tune_tokens` for FP8 experts at T = 1: the gemv path's up tiles, then its down tiles (on the best up tile's h),
    then the pair of them and the default as whole `fused_moe_fp8` calls."""
    from orinfer.kernels import moe_fp8_decode as gemv
    from orinfer.kernels.moe_ops import fused_moe_fp8

    (s13, s2), (w13, w2) = scales, banks[0]
    default = gemv.default_gemv_config(ids.shape[1], w2.shape[2])
    whole = {cfg: _time(lambda a, b, cfg=cfg: fused_moe_fp8(x, a, s13, b, s2, FP8_BLOCK, weights, ids, config=cfg),
                        banks) for cfg in dict.fromkeys([_gemv_stages(x, weights, ids, banks, scales, few), default])}
    best, best_us = _best(whole)
    return best, best_us, whole[default]


def gemv_candidates(tokens: int, dtype: torch.dtype) -> tuple[list[Tile], list[Tile]] | None:
    """The gemv path's (up, down) stage tiles that `tune_tokens` times at `tokens` for experts of `dtype`: FP8's
    (`moe_fp8_decode`) or bf16 / fp16's (`moe_gemv16`) at T = 1; None where the path does not run (more tokens,
    fp32)."""
    from orinfer.kernels import moe_fp8_decode, moe_gemv16

    if tokens != 1:
        return None
    if dtype == FP8_DTYPE:
        return moe_fp8_decode.UP_CANDIDATES, moe_fp8_decode.DOWN_CANDIDATES
    if dtype in moe_gemv16.DTYPES:
        return moe_gemv16.UP16_CANDIDATES, moe_gemv16.DOWN16_CANDIDATES
    return None


def _gemv_stages(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, banks: list,
                 scales: tuple | None, few: Callable[[list], list]) -> MoeConfig:
    """The gemv config of the fastest up tile, then of the fastest down tile on its h, each stage timed alone over
    `gemv_candidates`; scales: FP8 experts' (s13, s2), None for 16-bit ones."""
    from orinfer.kernels import moe_fp8_decode as gemv

    (s13, s2), block = (scales, FP8_BLOCK) if scales is not None else ((None, None), None)
    w13 = banks[0][0]
    ups, downs = gemv_candidates(1, w13.dtype)
    up, _ = _best({t: _time(lambda a, b, t=t: gemv.gemv_up(x, a, s13, block, ids, t), banks) for t in few(ups)})
    h = gemv.gemv_up(x, w13, s13, block, ids, up)
    down, _ = _best({t: _time(lambda a, b, t=t: gemv.gemv_down(h, b, s2, block, weights, ids, t), banks)
                     for t in few(downs)})
    return MoeConfig(GEMV, 1, up, down)


def tune_tokens_w4(tokens: int, banks: list, top_k: int, quick: bool = False, shared_slot: bool = False
                   ) -> tuple[MoeConfig, float, float]:
    """`tune_tokens` for 4-bit experts (banks of W4Experts pairs). Their kernels have no stage entry points, so
    every candidate is a whole `fused_moe_w4` call: first the up tiles beside the default down tile, then the down
    tiles and splits beside the best up tile."""
    from orinfer.kernels.moe_ops import fused_moe_w4
    from orinfer.kernels.moe_w4 import w4_config

    w13, _ = banks[0]
    dev, experts, hidden = w13.packed.device, w13.num_experts, w13.in_features
    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    weights, ids = routing(tokens, experts, top_k, dev, shared_slot)
    few = (lambda c: c[:2]) if quick else (lambda c: c)

    def timed(cfgs: list[MoeConfig]) -> dict[MoeConfig, float]:
        return {c: _time(lambda a, b, c=c: fused_moe_w4(x, a, b, weights, ids, config=c), banks)
                for c in dict.fromkeys(cfgs)}

    default = w4_config(default_config(tokens, experts, top_k, wide=False), W4_GROUP, W4_GROUP)
    results = timed([default])
    paths = []
    if tokens <= DECODE_MAX_TOKENS:
        paths += [("decode", 1, FMA_W4, SPLITS_FMA)] if tokens == 1 else []
        paths.append(("decode", 16, DOT_W4, SPLITS_DOT))
    rows = tokens * top_k / experts
    paths += [("grouped", m, GROUPED_W4, (1,)) for m in GROUPED_BLOCK_M
              if not ((m > 16 and rows < m / 4) or (quick and m > 32))]
    for path, block_m, tiles, splits in paths:
        base = MoeConfig(path, block_m, tiles[0], tiles[0], 1)
        ups = timed([base._replace(up=t) for t in few(tiles)])
        results.update(ups)
        with_best_up, _ = _best(ups)
        results.update(timed([with_best_up._replace(down=t, split=sp) for t in few(tiles) for sp in few(splits)
                              if sp <= tokens * top_k]))
    best, best_us = _best(results)
    return best, best_us, results[default]


# W8A8 expert tiles (`moe_a8`): up's block_n and both block_k are the FP8 block width (bk), so up varies in warps and
# stages only; down's block_n too. Rows a block: one warpgroup's 32 up to two warpgroups' 128.
A8_BLOCK_M = (32, 64, 128)
A8_UP = [(4, 3), (8, 3), (4, 4), (8, 4)]                                    # (num_warps, num_stages)
A8_DOWN = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 8, 3), (128, 4, 4), (64, 4, 4)]   # (block_n, warps, stages)


def a8_candidates(bk: int, quick: bool = False) -> tuple[list[MoeConfig], list[Tile]]:
    """What `tune_tokens_a8` races for FP8 blocks bk wide: the "a8" configs of every block_m with each up tile
    (beside a 128-wide down tile), and the down tiles it then tries with each block_m's best up tile."""
    few = (lambda c: c[:2]) if quick else (lambda c: c)
    ups = [MoeConfig(A8, m, Tile(bk, bk, w, s), Tile(128, bk, 4, 3), uniform_scale=m >= 64)  # as measured, run 460
           for m in few(A8_BLOCK_M) for w, s in few(A8_UP)]
    return ups, [Tile(n, bk, w, s) for n, w, s in few(A8_DOWN)]


def tune_tokens_a8(tokens: int, banks: list[tuple[torch.Tensor, torch.Tensor]], top_k: int,
                   scales: tuple[torch.Tensor, torch.Tensor], quick: bool = False, shared_slot: bool = False
                   ) -> tuple[MoeConfig, float, float]:
    """`tune_tokens` for the W8A8 kernels of FP8 experts (16-bit x, tokens from moe_a8.MIN_TOKENS): whole
    `fused_moe_fp8` calls with forced "a8" configs. First the up candidates of `a8_candidates`, then each block_m's
    best with every down tile, then the best with uniform_scale flipped; the default (`moe_a8.default_config`)
    races too."""
    from orinfer.kernels import moe_a8
    from orinfer.kernels.moe_ops import fused_moe_fp8

    (s13, s2), (w13, _) = scales, banks[0]
    experts, _, hidden = w13.shape
    dev = w13.device
    x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
    weights, ids = routing(tokens, experts, top_k, dev, shared_slot)

    def timed(cfgs: list[MoeConfig]) -> dict[MoeConfig, float]:
        return {c: _time(lambda a, b, c=c: fused_moe_fp8(x, a, s13, b, s2, FP8_BLOCK, weights, ids, config=c),
                         banks) for c in dict.fromkeys(cfgs)}

    default = moe_a8.as_config(moe_a8.default_config(tokens))
    results = timed([default])
    ups, downs = a8_candidates(FP8_BLOCK[1], quick)
    results.update(timed(ups))
    for block_m in dict.fromkeys(c.block_m for c in ups):   # each block_m's best up tile with every down tile
        best_up, _ = _best({c: us for c, us in results.items() if c.block_m == block_m})
        results.update(timed([best_up._replace(down=down) for down in downs]))
    best, _ = _best(results)
    results.update(timed([best._replace(uniform_scale=not best.uniform_scale)]))
    best, best_us = _best(results)
    return best, best_us, results[default]


def _fp8_tiles(tiles: list[Tile]) -> list[Tile]:
    """The tensor-core tiles with K steps inside one FP8 scale column (block_k <= 128), without repeats."""
    return list(dict.fromkeys(t._replace(block_k=min(t.block_k, FP8_BLOCK[1])) for t in tiles))


def tune(experts: int, hidden: int, inter: int, top_k: int, tokens: tuple[int, ...] = TOKENS,
         dtype: torch.dtype | str = torch.bfloat16, out_dir: Path = TABLE_DIR, quick: bool = False,
         log: Callable[[str], None] = print, shared_slot: bool = False) -> Path:
    """Tunes every token count and writes the table; returns its path. `dtype`: the experts' weights, a torch dtype
    (16-bit, or float8_e4m3fn: FP8 block-wise) or "w4" (4-bit experts in groups of W4_GROUP); `shared_slot`: the
    last of the `experts` is a folded shared expert, in every token's `top_k` pairs (`routing`)."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device=dev) * inter ** -0.5
    scales, weights = None, dtype
    if dtype == "w4":  # random codes: the kernels' speed does not depend on the values
        from orinfer.bench.moe_w4_rows import random_w4_experts

        w13, w2, weights = random_w4_experts(w13, W4_GROUP), random_w4_experts(w2, W4_GROUP), w4_label(W4_GROUP)
        banks = [(w13, w2)] + [(_copy_w4(w13), _copy_w4(w2)) for _ in range(BANKS - 1)]
    else:
        if dtype == FP8_DTYPE:  # random codes with unit block scales, likewise
            shapes = expert_scale_shapes(experts, hidden, inter, FP8_BLOCK)
            scales = (torch.ones(shapes[0], device=dev), torch.ones(shapes[1], device=dev))
        w13, w2 = w13.to(dtype), w2.to(dtype)
        banks = [(w13, w2)] + [(w13.clone(), w2.clone()) for _ in range(BANKS - 1)]
    from orinfer.kernels.moe_a8 import MIN_TOKENS

    configs: dict[str, dict] = {}
    a8_configs: dict[str, dict] = {}
    for t in tokens:
        if dtype == "w4":
            cfg, us, default_us = tune_tokens_w4(t, banks, top_k, quick, shared_slot)
        else:
            cfg, us, default_us = tune_tokens(t, banks, top_k, quick, scales, shared_slot)
        configs[str(t)] = {**config_to_json(cfg), "us": round(us, 2), "default_us": round(default_us, 2)}
        log(f"T={t}: {cfg} {us:.1f} us (default {default_us:.1f} us)")
        if scales is not None and t >= MIN_TOKENS:
            cfg, us, default_us = tune_tokens_a8(t, banks, top_k, scales, quick, shared_slot)
            a8_configs[str(t)] = {**config_to_json(cfg), "us": round(us, 2), "default_us": round(default_us, 2)}
            log(f"T={t} W8A8: {cfg} {us:.1f} us (default {default_us:.1f} us)")
    shape, gpu = (experts, hidden, inter, top_k), torch.cuda.get_device_name(dev)
    path = _write_table(out_dir, gpu, shape, weights, configs)
    if a8_configs:
        log(f"wrote {_write_table(out_dir, gpu, shape, W8A8_LABEL, a8_configs)}")
    return path


def _write_table(out_dir: Path, device_name: str, shape: tuple[int, int, int, int], weights: torch.dtype | str,
                 configs: dict[str, dict]) -> Path:
    """Writes (or updates) the table of this GPU, expert shape (E, H, I, k) and weights label; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / table_name(device_name, *shape, weights)
    if path.is_file():                          # entries of other token counts (an earlier run) are kept
        configs = {**json.loads(path.read_text())["configs"], **configs}
    configs = dict(sorted(configs.items(), key=lambda item: int(item[0])))
    experts, hidden, inter, top_k = shape
    table = {"device": device_name, "experts": experts, "hidden": hidden, "inter": inter, "top_k": top_k,
             "dtype": weights if isinstance(weights, str) else str(weights).removeprefix("torch."), "configs": configs}
    path.write_text(json.dumps(table, indent=1) + "\n")
    load_table.cache_clear()
    return path


def _copy_w4(w):
    return type(w)(w.packed.clone(), w.scales.clone(), w.zeros.clone(), w.group_size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="E, H, I and k of a released model")
    p.add_argument("--experts", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--inter", type=int, help="the expert FFN's intermediate size I (w2 is [E, H, I])")
    p.add_argument("--top-k", type=int)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float8_e4m3fn", "w4"],
                   help="the experts' weights (float8_e4m3fn: FP8 block-wise experts; w4: AWQ / GPTQ-Int4 experts "
                        f"in groups of {W4_GROUP}; both with bf16 activations)")
    p.add_argument("--out", type=Path, default=TABLE_DIR, help="folder of the table (default: the package's)")
    p.add_argument("--shared-slot", action="store_true",
                   help="the experts also hold a folded shared expert (Qwen3.5-MoE): one more slot, in every token's "
                        "pairs; the table is for E + 1 experts and top-k + 1")
    p.add_argument("--quick", action="store_true", help="two candidates per stage (a smoke run)")
    args = p.parse_args(argv)
    shape = PRESETS[args.preset] if args.preset else (args.experts, args.hidden, args.inter, args.top_k)
    if None in shape:
        p.error("give --preset, or all of --experts --hidden --inter --top-k")
    if args.shared_slot:
        experts, hidden, inter, top_k = shape
        shape = (experts + 1, hidden, inter, top_k + 1)
    if not torch.cuda.is_available():
        print("tuning the MoE kernels needs a CUDA device")
        return 1
    tokens = tuple(int(t) for t in args.tokens.split(","))
    dtype = args.dtype if args.dtype == "w4" else getattr(torch, args.dtype)
    path = tune(*shape, tokens=tokens, dtype=dtype, out_dir=args.out, quick=args.quick, shared_slot=args.shared_slot)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
