"""Kernel micro-benchmark: each Triton kernel against the torch sequence it replaces, on Qwen3-8B shapes (and the
Qwen3-VL-8B vision tower's kernels at the shapes of one 1024x768 image, `_vision_rows`; the MoE router and experts of
Qwen3-30B-A3B, `_moe_rows`, and its FP8 experts against the 16-bit ones, `_moe_fp8_rows`, and its 4-bit ones,
bench/moe_w4_rows.py: their "torch" row is the 16-bit `fused_moe`; the FP8 experts of Qwen3.5-35B-A3B and Qwen3-30B-A3B
at one token, the gemv path against the old decode path, bench/moe_fp8_gemv_rows.py; the 16-bit experts of
Qwen3-30B-A3B at one token likewise, bench/moe_gemv16_rows.py).

Every row reports the median time (CUDA events around the op alone, after warm-up, with the L2 cache flushed
before each timed call so weights come from HBM as they do in a real decode step), the bytes the op must move at
minimum, the achieved GB/s and its share of the device's read bandwidth measured in the same run (a reduction over
a 4 GiB buffer). Attention prefill and MoE rows add TFLOP/s. Run: `python -m orinfer.bench.kernels [--sections
dense,vision,moe]` (needs a CUDA device; importing this module does not). The FP8 block-wise kernels against these bf16
ones: `python -m orinfer.bench.fp8_kernels`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Callable

import torch
import torch.nn.functional as F

# Qwen3-8B
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 12288, 32, 8, 128, 151936
EPS = 1e-6
# Qwen3-VL-8B's vision tower: a 1024x768 image is 64x48 = 3072 patches of width 1152, 16 heads of 72, MLP 4304;
# the mergers see 768 rows of 4*1152 after the 2x2 merge.
VIS_PATCHES, VIS_HIDDEN, VIS_INTER, VIS_HEADS, VIS_HEAD_DIM, VIS_MERGE = 3072, 1152, 4304, 16, 72, 4
# Qwen3-30B-A3B's MoE layer: 128 experts of [2*768, 2048] gate/up and [2048, 768] down, 8 per token.
MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_TOP_K = 128, 2048, 768, 8
SECTIONS = ("dense", "vision", "moe")


class _Timer:
    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.iters, self.warmup = iters, warmup
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)  # larger than the H200's 50 MB L2

    def __call__(self, fn: Callable[[], object]) -> float:
        """Median microseconds of fn()."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
        return sorted(times)[len(times) // 2]


def read_bandwidth_gbps(device: torch.device, gib: float = 4.0) -> float:
    x = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device=device).uniform_()
    timer = _Timer(device, iters=10, warmup=3)
    us = timer(lambda: x.sum())
    del x
    torch.cuda.empty_cache()
    return gib * 2**30 / us / 1e3


def _paged_cache(ctx: int, batch: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM):
    """Random K/V caches [batch * ceil(ctx / block_size), block_size, kv_heads, head_dim] holding `batch` sequences of
    `ctx` tokens each, their block tables [batch, ceil(ctx / block_size)] (int32, a random permutation of every
    block) and context lengths [batch]."""
    blocks_per_seq = math.ceil(ctx / block_size)
    num_blocks = blocks_per_seq * batch
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)  # scattered blocks, as after churn
    block_tables = perm.view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, context_lens


def run_kernel_bench(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, iters: int = 50,
                     batches: tuple[int, ...] = (1, 8), sections: tuple[str, ...] = SECTIONS) -> list[dict]:
    """Rows of {op, shape, impl, us, bytes, GBps, pct_read_bw, speedup (torch us / triton us), config} for the
    `sections` asked for (dense: Qwen3-8B's kernels; vision; moe)."""
    dev = torch.device(device)
    torch.manual_seed(0)
    read_gbps = read_bandwidth_gbps(dev)
    timer = _Timer(dev, iters=iters, warmup=5)
    esize = torch.empty((), dtype=dtype).element_size()
    rows: list[dict] = [{"op": "read bandwidth (x.sum, 4 GiB fp32)", "shape": "", "impl": "torch", "us": None,
                         "bytes": 4 * 2**30, "GBps": read_gbps, "pct_read_bw": 100.0}]

    def add(op: str, shape: str, nbytes: float, triton_fn, torch_fn, flops: float | None = None,
            config: str = "") -> None:
        t_us = timer(triton_fn)
        r_us = timer(torch_fn) if torch_fn is not None else None
        for impl, us in (("triton", t_us), ("torch", r_us)):
            if us is None:
                continue
            row = {"op": op, "shape": shape, "impl": impl, "us": us, "bytes": nbytes, "GBps": nbytes / us / 1e3,
                   "pct_read_bw": 100.0 * nbytes / us / 1e3 / read_gbps}
            if flops:
                row["TFLOPs"] = flops / us / 1e6
            if impl == "triton":
                row["speedup"] = (r_us / t_us) if r_us else None
                row["config"] = config
            rows.append(row)

    def randn(*shape, scale: float = 1.0):
        return torch.randn(*shape, device=dev, dtype=torch.float32).mul_(scale).to(dtype)

    if "dense" in sections:
        _dense_rows(add, randn, dev, dtype, esize, batches)
    if "vision" in sections:
        _vision_rows(add, randn, dev, esize)
    if "moe" in sections:
        _moe_rows(add, randn, dev, esize)
    return rows


def _dense_rows(add: Callable, randn: Callable, dev: torch.device, dtype: torch.dtype, esize: int,
                batches: tuple[int, ...]) -> None:
    """Qwen3-8B's kernels (norms, RoPE, SwiGLU, GEMVs, attention, KV store) against the torch sequences."""
    from orinfer.kernels import activation, attention, decode_attention, gemv, norm, rotary  # imports triton

    # RMSNorm + residual: fused vs add then norm.
    w_norm = randn(HIDDEN, scale=0.1).add_(1)
    for t in (1, 2048):
        x, r = randn(t, HIDDEN), randn(t, HIDDEN)
        add("rms_norm+residual", f"T={t} H={HIDDEN}", (4 * t * HIDDEN + HIDDEN) * esize,
            lambda: norm.rms_norm(x, w_norm, EPS, r), lambda: norm.rms_norm_ref(x, w_norm, EPS, r))

    # QK-norm + RoPE on slices of a packed qkv row.
    cos_sin = rotary.rope_cos_sin_cache(HEAD_DIM, 40960, 1e6, device=dev)
    qw, kw = randn(HEAD_DIM, scale=0.1).add_(1), randn(HEAD_DIM, scale=0.1).add_(1)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for t in (1, 2048):
        qkv = randn(t, q_size + 2 * kv_size)
        q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
        pos = torch.randint(0, 4096, (t,), device=dev)
        add("qk_norm_rope", f"T={t} Hq={HEADS} Hk={KV_HEADS} D={HEAD_DIM}", 2 * t * (q_size + kv_size) * esize,
            lambda: rotary.qk_norm_rope(q, k, pos, cos_sin, HEAD_DIM, qw, kw, EPS),
            lambda: rotary.qk_norm_rope_ref(q, k, pos, cos_sin, HEAD_DIM, qw, kw, EPS))

    # SwiGLU on a prefill-sized gate_up.
    gu = randn(2048, 2 * INTER)
    add("silu_and_mul", f"T=2048 I={INTER}", 3 * 2048 * INTER * esize,
        lambda: activation.silu_and_mul(gu), lambda: activation.silu_and_mul_ref(gu))

    # Decode GEMVs (weights read once) and the fused gate/up + SwiGLU.
    w_gate_up = randn(2 * INTER, HIDDEN, scale=0.02)
    for b in batches:
        x = randn(b, HIDDEN)
        activation.fused_gate_up_silu(x, w_gate_up)  # tunes once, outside the timing
        cfg = (gemv.TUNER.cache.get((INTER, HIDDEN, gemv.rows_bucket(b), True, False, dtype, dtype, str(x.device)))
               or (gemv.fixed_config(b, True, dtype, dtype, HIDDEN, INTER, gemv.cuda_sm_count(x.device) or 0)
                   if b >= activation.FUSED_MIN_ROWS
                   else "unfused: GEMV + silu_and_mul"))
        add("fused gate_up+silu", f"B={b} H={HIDDEN} I={INTER}", (2 * INTER * HIDDEN + b * (HIDDEN + INTER)) * esize,
            lambda: activation.fused_gate_up_silu(x, w_gate_up),
            lambda: activation.silu_and_mul_ref(F.linear(x, w_gate_up)), config=str(cfg))
    del w_gate_up
    shapes = {"qkv": (q_size + 2 * kv_size, HIDDEN), "o": (HIDDEN, q_size), "down": (HIDDEN, INTER),
              "lm_head": (VOCAB, HIDDEN)}
    for name, (n, k) in shapes.items():
        w = randn(n, k, scale=0.02)
        for b in batches:
            x = randn(b, k)
            gemv.gemv(x, w)
            cfg = (gemv.TUNER.cache.get((n, k, gemv.rows_bucket(b), False, False, dtype, dtype, str(x.device)))
                   or gemv.fixed_config(b, False, dtype, dtype, k))
            add(f"gemv {name}", f"B={b} N={n} K={k}", (n * k + b * (n + k)) * esize,
                lambda: gemv.gemv(x, w), lambda: F.linear(x, w), config=str(cfg))
        del w
    torch.cuda.empty_cache()

    # Paged decode attention vs SDPA on contiguous K/V (the reference loop is far too slow to time).
    scale = HEAD_DIM ** -0.5
    for ctx in (512, 4096):
        for b in batches:
            k_cache, v_cache, tables, lens = _paged_cache(ctx, b, 16, dtype, dev)
            q = randn(b, HEADS, HEAD_DIM)
            k_flat = k_cache[tables.long()].reshape(b, -1, KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
            v_flat = v_cache[tables.long()].reshape(b, -1, KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
            q4 = q.unsqueeze(2)
            add("paged decode attention", f"B={b} ctx={ctx} Hq={HEADS} Hk={KV_HEADS}",
                2 * b * ctx * kv_size * esize,
                lambda: decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale),
                lambda: F.scaled_dot_product_attention(q4, k_flat, v_flat, scale=scale, enable_gqa=True))
            del k_cache, v_cache, k_flat, v_flat

    # Prefill attention: varlen flash kernel vs causal SDPA on one sequence.
    for length in (512, 2048):
        q, k, v = randn(length, HEADS, HEAD_DIM), randn(length, KV_HEADS, HEAD_DIM), randn(length, KV_HEADS, HEAD_DIM)
        qsl = torch.tensor([0, length], dtype=torch.int32, device=dev)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        flops = 4 * HEADS * HEAD_DIM * length * (length + 1) / 2
        add("varlen attention (prefill)", f"L={length} Hq={HEADS} Hk={KV_HEADS}",
            (2 * length * q_size + 2 * length * kv_size) * esize,
            lambda: attention.varlen_attention(q, k, v, qsl, scale, max_seqlen=length),
            lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True),
            flops=flops)

    # KV store of a prefill chunk.
    t = 2048
    k_new, v_new = randn(t, KV_HEADS, HEAD_DIM), randn(t, KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(t // 16 * 2, 16, KV_HEADS, HEAD_DIM, dtype=dtype, device=dev)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * 16, device=dev)[:t]
    add("store_kv", f"T={t} Hk={KV_HEADS} D={HEAD_DIM}", 4 * t * kv_size * esize,
        lambda: attention.store_kv(k_new, v_new, k_cache, v_cache, slots),
        lambda: attention.store_kv_ref(k_new, v_new, k_cache, v_cache, slots))
    del k_cache, v_cache
    torch.cuda.empty_cache()


def _vision_rows(add: Callable, randn: Callable, dev: torch.device, esize: int) -> None:
    """The vision tower's kernels against the torch sequences they replace (torch's own fused F.layer_norm for the
    norm; the add + GELU and add + add pairs; the reference split/rotate/transpose; SDPA per image + the transpose
    back to token-major), at Qwen3-VL-8B shapes. Attention rows add TFLOP/s (4*Dh*H*sum(L^2) flops)."""
    from orinfer.kernels import vision  # imports triton

    n, d, heads, head_dim = VIS_PATCHES, VIS_HIDDEN, VIS_HEADS, VIS_HEAD_DIM
    for rows, dim, what in ((n, d, "block norm"), (n // VIS_MERGE, VIS_MERGE * d, "post-shuffle merger norm")):
        x, w, b = randn(rows, dim), randn(dim, scale=0.1).add_(1), randn(dim, scale=0.1)
        add(f"vision layer_norm ({what})", f"N={rows} D={dim}", (2 * rows * dim + 2 * dim) * esize,
            lambda: vision.layer_norm(x, w, b, EPS), lambda: F.layer_norm(x, (dim,), w, b, EPS))
    for rows, dim, approx in ((n, VIS_INTER, "tanh"), (n // VIS_MERGE, VIS_MERGE * d, "none")):
        x, b = randn(rows, dim), randn(dim)
        add(f"vision bias_gelu ({approx})", f"N={rows} D={dim}", (2 * rows * dim + dim) * esize,
            lambda: vision.bias_gelu(x, b, approx), lambda: F.gelu(x + b, approximate=approx))
    x, b, r = randn(n, d), randn(d), randn(n, d)
    add("vision bias_residual", f"N={n} D={d}", (3 * n * d + d) * esize,
        lambda: vision.bias_residual(x, b, r), lambda: r + (x + b))
    qkv = randn(n, 3 * heads * head_dim)
    angles = torch.rand(n, head_dim // 2, device=dev) * 64
    cos, sin = angles.cos(), angles.sin()  # fp32, as the tower computes them
    add("vision qkv_split_rope", f"N={n} H={heads} Dh={head_dim}",
        6 * n * heads * head_dim * esize + 2 * n * (head_dim // 2) * 4,
        lambda: vision.qkv_split_rope(qkv, cos, sin, heads),
        lambda: vision.qkv_split_rope_ref(qkv, cos, sin, heads))
    scale = head_dim ** -0.5
    d_lo, d_hi = vision.head_split(head_dim)
    for lengths in ([n], [n // 3] * 3):
        tokens = sum(lengths)
        q, k, v = (randn(heads, tokens, head_dim) for _ in range(3))
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
        out = torch.empty(tokens, heads * head_dim, dtype=q.dtype, device=dev)

        def sdpa_per_image(q=q, k=k, v=v, bounds=bounds, out=out):
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                o = F.scaled_dot_product_attention(q[None, :, lo:hi], k[None, :, lo:hi], v[None, :, lo:hi], scale=scale)
                out[lo:hi] = o[0].transpose(0, 1).reshape(hi - lo, heads * head_dim)
            return out

        add("vision attention (non-causal, per image)", f"L={'+'.join(map(str, lengths))} H={heads} Dh={head_dim}",
            4 * tokens * heads * head_dim * esize,
            lambda: vision.vision_attention(q, k, v, cu, max(lengths), scale), sdpa_per_image,
            flops=4 * head_dim * heads * sum(length * length for length in lengths),
            config=f"Dh {d_lo}+{d_hi}" if d_hi else f"Dh {d_lo}")


def _moe_rows(add: Callable, randn: Callable, dev: torch.device, esize: int) -> None:
    """Qwen3-30B-A3B's MoE layer: the router (softmax + top-k fused vs torch), and the routed experts (`fused_moe`,
    whatever path and tiles its config picks for the token count; torch: the reference's loop over the chosen
    experts, cuBLAS per expert) at decode batches 1, 8, 64 and a 2048-token prefill. Bytes: the weights of the
    distinct experts the random routing chose (each read once), x and the output; flops 2 * T * k * 3 * H * I."""
    from orinfer.kernels import moe_config
    from orinfer.kernels.moe import fused_moe_ref, moe_route_ref
    from orinfer.kernels.moe_ops import fused_moe, moe_route  # imports triton

    n_exp, hidden, inter, top_k = MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_TOP_K
    w13 = randn(n_exp, 2 * inter, hidden, scale=hidden ** -0.5)
    w2 = randn(n_exp, hidden, inter, scale=inter ** -0.5)
    for t in (1, 2048):
        logits = randn(t, n_exp)
        add("moe_route (softmax+top-k)", f"T={t} E={n_exp} k={top_k}", t * (n_exp * esize + top_k * 8),
            lambda: moe_route(logits, top_k, True), lambda: moe_route_ref(logits, top_k, True))
    _moe_router_rows(add, randn, hidden, top_k, esize)
    for t in (1, 8, 64, 2048):
        x = randn(t, hidden)
        weights, ids = moe_route(randn(t, n_exp), top_k, True)
        active = ids.unique().numel()
        nbytes = active * 3 * hidden * inter * esize + 2 * t * hidden * esize + t * top_k * 8
        cfg = moe_config.pick_config(x, w13, top_k)
        add("fused_moe (prefill)" if t > 64 else "fused_moe (decode)",
            f"T={t} E={n_exp} H={hidden} I={inter} k={top_k} ({active} experts)", nbytes,
            lambda: fused_moe(x, w13, w2, weights, ids), lambda: fused_moe_ref(x, w13, w2, weights, ids),
            flops=2 * t * top_k * 3 * hidden * inter,
            config=f"{cfg.path} bm={cfg.block_m} up={tuple(cfg.up)} down={tuple(cfg.down)} split={cfg.split}")
    _moe_fp8_rows(add, randn, w13, w2, top_k, esize)
    from orinfer.bench.moe_w4_rows import moe_w4_rows
    moe_w4_rows(add, randn, w13, w2, top_k, esize)
    del w13, w2
    torch.cuda.empty_cache()
    from orinfer.bench.moe_fp8_gemv_rows import moe_fp8_gemv_rows
    moe_fp8_gemv_rows(add, randn, esize)
    from orinfer.bench.moe_gemv16_rows import moe_gemv16_rows
    moe_gemv16_rows(add, randn, esize)


def _moe_router_rows(add: Callable, randn: Callable, hidden: int, top_k: int, esize: int) -> None:
    """The fused router (kernels/moe_router.py: GEMV, softmax, top-k and the shared gate's logit in one launch) against
    the triton backend's two-kernel path it replaces (the linear, then moe_route; "torch" column), for Qwen3-30B-A3B's
    128 experts and Qwen3.5-35B-A3B's 256 + the shared gate row (also folded: the shared expert's pair appended, k + 1
    out). Bytes: the router weight, x, the routing."""
    from orinfer.kernels.moe_ops import moe_route
    from orinfer.kernels.moe_router import default_config, moe_router
    from orinfer.layers.triton_ops import triton_linear

    for n_exp, rows, fold in ((128, 128, False), (256, 257, False), (256, 257, True)):
        w = randn(rows, hidden, scale=hidden ** -0.5)
        for t in (1, 8, 16):
            x = randn(t, hidden)

            def unfused(x=x, w=w, n_exp=n_exp, fold=fold):
                logits = triton_linear(x, w)
                if fold:
                    return moe_route(logits[:, :n_exp], top_k, True, shared_logit=logits[:, n_exp:])
                return moe_route(logits[:, :n_exp], top_k, True), logits[:, n_exp:]

            cfg = default_config(t, x.dtype, w.dtype)
            add("moe_router (GEMV+top-k, one launch) vs linear+moe_route",
                f"T={t} E={n_exp} rows={rows}{' folded' if fold else ''} H={hidden}",
                rows * hidden * esize + t * hidden * esize + t * (top_k + fold) * 8,
                lambda x=x, w=w, n_exp=n_exp, fold=fold: moe_router(x, w, top_k, True, n_exp, fold), unfused,
                config=f"{'dot' if cfg.use_dot else 'fma'} n={cfg.block_n} k={cfg.block_k} w={cfg.num_warps}")


def _moe_fp8_rows(add: Callable, randn: Callable, w13: torch.Tensor, w2: torch.Tensor, top_k: int, esize: int
                  ) -> None:
    """The same experts in FP8 block-wise (128 x 128, Qwen3-30B-A3B-FP8's format: `fused_moe_fp8`), timed against
    the 16-bit `fused_moe` on the same routing (its "speedup" is over the 16-bit kernels, not torch). Bytes: one per
    weight of the chosen experts, their scales, x and the output."""
    from orinfer.kernels.fp8_block import fp8_block_quantize
    from orinfer.kernels.moe_config import pick_config
    from orinfer.kernels.moe_fp8 import fp8_config
    from orinfer.kernels.moe_ops import fused_moe, fused_moe_fp8, moe_route

    n_exp, two_inter, hidden = w13.shape
    inter, block = two_inter // 2, (128, 128)

    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # rows divide by 128: per-expert blocks
        q, s = fp8_block_quantize(w.reshape(-1, w.shape[2]), block)
        return q.view(w.shape), s.view(w.shape[0], -1, s.shape[1])

    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    for t in (1, 8, 64, 2048):
        x = randn(t, hidden)
        weights, ids = moe_route(randn(t, n_exp), top_k, True)
        active = ids.unique().numel()
        nbytes = active * 3 * hidden * inter * (1 + 4 / 128 ** 2) + 2 * t * hidden * esize + t * top_k * 8
        cfg = fp8_config(pick_config(x, q13, top_k), block[1])
        add("fused_moe_fp8 (prefill) vs 16-bit" if t > 64 else "fused_moe_fp8 (decode) vs 16-bit",
            f"T={t} E={n_exp} H={hidden} I={inter} k={top_k} ({active} experts)", nbytes,
            lambda: fused_moe_fp8(x, q13, s13, q2, s2, block, weights, ids),
            lambda: fused_moe(x, w13, w2, weights, ids), flops=2 * t * top_k * 3 * hidden * inter,
            config=f"{cfg.path} bm={cfg.block_m} up={tuple(cfg.up)} down={tuple(cfg.down)} split={cfg.split}")


def markdown(rows: list[dict], speedup: str = "speedup vs torch") -> str:
    """The rows as a markdown table (a value a row lacks is left blank); `speedup` heads the speedup column."""
    lines = [f"| op | shape | impl | us | GB/s | % read BW | TFLOP/s | {speedup} | config |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        def num(key: str, fmt: str, r: dict = r) -> str:
            return format(r[key], fmt) if r.get(key) is not None else ""
        lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {num('us', '.1f')} | {num('GBps', '.0f')} "
                     f"| {num('pct_read_bw', '.1f')} | {num('TFLOPs', '.1f')} | {num('speedup', '.2f')}"
                     f"{'x' if r.get('speedup') is not None else ''} | {r.get('config', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated: dense (Qwen3-8B), vision (Qwen3-VL-8B's tower), moe (Qwen3-30B-A3B)")
    args = p.parse_args(argv)
    sections = tuple(s for s in args.sections.split(",") if s)
    if not set(sections) <= set(SECTIONS):
        p.error(f"--sections takes {', '.join(SECTIONS)}")
    if not torch.cuda.is_available():
        print("the kernel benchmark needs a CUDA device")
        return 1
    rows = run_kernel_bench(args.device, getattr(torch, args.dtype), args.iters, sections=sections)
    report(rows, markdown(rows), f"Kernel micro-benchmark on {{device}} ({args.dtype}; sections "
           f"{', '.join(sections)}: Qwen3-8B, Qwen3-VL-8B vision and Qwen3-30B-A3B MoE shapes)", args.device,
           args.json, dtype=args.dtype)
    return 0


def report(rows: list[dict], table: str, title: str, device: str, json_path: str | None, md_path: str | None = None,
           **meta: object) -> None:
    """Prints `title` ({device} filled in) and the table; writes {device, **meta, rows} to `json_path` and the title
    and table to `md_path` if given (their folders made)."""
    name = torch.cuda.get_device_name(torch.device(device))
    text = f"# {title.format(device=name)}\n\n{table}\n"
    print(text)
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"device": name, **meta, "rows": rows}, f, indent=1, default=str)
    if md_path:
        os.makedirs(os.path.dirname(md_path) or ".", exist_ok=True)
        with open(md_path, "w") as f:
            f.write(text)


if __name__ == "__main__":
    raise SystemExit(main())
