"""Every GEMV config on a model's decode shapes (default Qwen3-8B) at 1, 2, 4 and 8 rows of x (bf16): one-row FMA (1
row), multi-row FMA (kernels/gemv_rows.py), tensor-core DOT and cuBLAS, each timed alone, for choosing the defaults of
kernels/gemv.py; with --fp8, every one-row tile of `fp8_gemv` on the same shapes in FP8 block-wise weights.

Shapes (`--preset`, the `orinfer bench --synthetic` names; Qwen3-8B's in brackets): qkv [6144x4096] (with the output
gate's rows on Qwen3.5), o [4096x4096], on hybrid models linear attention's in_proj and out_proj, on models with
dense MLP layers the fused gate_up + SwiGLU [2x12288x4096] (gated configs; cuBLAS = GEMM + silu_and_mul) and down
[4096x12288], and, with `--lm-head`, the lm_head [151936x4096]. Each row reports us, GB/s and % of the read bandwidth
measured in the same run (bytes: the weight once, x and the output), "vs 1 row": the 1-row default's time on the
shape over this time (1.00 = as cheap as one row; --fp8: the default tile's time over this one), and which config
each loop's default is ("default": what `gemv` or `fp8_gemv` runs today; "fma default": what
ORINFER_GEMV_FEW_ROWS=fma runs). Timing as bench/fp8_kernels.py: the calls over enough copies of the weight (4x L2)
captured in one CUDA graph, so every call reads its weight from HBM; median of --iters replays per call.

Run: `python -m orinfer.bench.gemv_sweep [--preset qwen3.5-35b-a3b] [--fp8] [--lm-head] [--rows 1,2,4,8]
[--tensor-parallel-size N] [--iters 20] [--out DIR] [--json FILE]` (needs a CUDA device; importing this module does not); --out writes DIR/gemv-sweep.md and
DIR/gemv-sweep.json.
"""

from __future__ import annotations

import argparse
import os

import torch

from orinfer.bench.fp8_kernels import graph_us
from orinfer.bench.kernels import markdown, read_bandwidth_gbps, report
from orinfer.config import ModelConfig, preset


def decode_shapes(cfg: ModelConfig, lm_head: bool = False, tp: int = 1) -> dict[str, tuple[int, int, bool]]:
    """A model's decode GEMVs: name -> (outputs N, K, gated: the weight is [2N, K]). Full attention's qkv (with the
    Qwen3.5 output gate's rows when it has one) and o; linear attention's packed in_proj (qkv | z | b | a) and out_proj
    (hybrid models); the dense MLP's gate_up and down unless every layer routes to experts. `tp`: one GPU's share
    under tensor parallelism of that size (qkv, in_proj, gate_up and the lm_head split by rows, o, out_proj and down
    by columns; KV heads replicated when fewer than `tp`)."""
    kv = max(cfg.num_key_value_heads // tp, 1) * cfg.head_dim
    q = cfg.q_size * (2 if cfg.attn_output_gate else 1) // tp
    shapes = {"qkv": (q + 2 * kv, cfg.hidden_size, False), "o": (cfg.hidden_size, cfg.q_size // tp, False)}
    if cfg.is_hybrid:
        shapes["in_proj"] = ((cfg.linear_conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads) // tp,
                             cfg.hidden_size, False)
        shapes["out_proj"] = (cfg.hidden_size, cfg.linear_value_dim // tp, False)
    if cfg.num_sparse_layers < cfg.num_hidden_layers:
        shapes["gate_up"] = (cfg.intermediate_size // tp, cfg.hidden_size, True)
        shapes["down"] = (cfg.hidden_size, cfg.intermediate_size // tp, False)
    if lm_head:
        shapes["lm_head"] = (-(-cfg.vocab_size // tp), cfg.hidden_size, False)
    return shapes


def loop_name(cfg) -> str:
    from orinfer.kernels import gemv

    if cfg == gemv.CUBLAS:
        return "cuBLAS"
    return "DOT" if cfg.use_dot else "multi-row FMA" if cfg.multi_row else "one-row FMA"


def label(cfg) -> str:
    """A config as BLOCK_N x BLOCK_K, warps, stages ("-" for cuBLAS)."""
    return "-" if cfg.block_n == 0 else f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"


def configs(rows: int, gated: bool, k: int | None = None, n: int | None = None, sms: int = 0) -> list:
    """The candidates of every loop that can run `rows` rows (`tuning_plan`'s, plus the fixed defaults)."""
    from orinfer.kernels import gemv

    multi = gemv.ROWS_CONFIGS_GATED if gated else gemv.ROWS_CONFIGS
    cands = (gemv.FMA_CONFIGS if rows == 1 else []) + (multi if rows <= gemv.MAX_FMA_ROWS else [])
    cands += gemv.DOT_CONFIGS + [gemv.CUBLAS]
    default = gemv.fixed_config(rows, gated, torch.bfloat16, torch.bfloat16, k, n, sms)
    return cands + ([default] if default not in cands else [])


def run_gemv_sweep(device: str = "cuda", rows_list: tuple[int, ...] = (1, 2, 4, 8), iters: int = 20,
                   shapes: dict[str, tuple[int, int, bool]] | None = None) -> list[dict]:
    """Rows of {op, shape, impl, us, bytes, GBps, pct_read_bw, speedup (vs the 1-row default), config}."""
    from orinfer.kernels import gemv

    dev = torch.device(device)
    torch.manual_seed(0)
    read_gbps = read_bandwidth_gbps(dev)
    out: list[dict] = [{"op": "read bandwidth (x.sum, 4 GiB fp32)", "shape": "", "impl": "torch", "us": None,
                        "bytes": 4 * 2**30, "GBps": read_gbps, "pct_read_bw": 100.0}]
    dtype = torch.bfloat16
    for name, (n, k, gated) in (shapes or decode_shapes(preset("qwen3-8b"))).items():
        w = (torch.randn(2 * n if gated else n, k, device=dev) * k ** -0.5).to(dtype)
        w_bytes = w.numel() * w.element_size()
        copies = [w]  # grown to what graph_us asks for
        one_row_us = None
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev).to(dtype)
            nbytes = w_bytes + rows * (k + n) * 2
            marks = {gemv.fixed_config(rows, gated, dtype, dtype, k, n, gemv.cuda_sm_count(x.device) or 0): "default"}
            if 2 <= rows <= gemv.MAX_FMA_ROWS:
                marks[gemv.FEW_ROWS_FMA_GATED if gated else gemv.FEW_ROWS_FMA] = "fma default"
            timed = []
            for cfg in configs(rows, gated, k, n, gemv.cuda_sm_count(x.device) or 0):
                def calls(count: int, cfg=cfg, x=x) -> list:
                    copies.extend(w.clone() for _ in range(count - len(copies)))
                    return [lambda wc=wc: gemv.launch_gemv(x, wc, None, n, gated, cfg) for wc in copies[:count]]
                try:
                    us = graph_us(calls, w_bytes, iters)
                except Exception as e:  # a config that does not compile or fit is reported, not fatal
                    out.append({"op": name, "shape": f"B={rows} N={n} K={k}", "impl": loop_name(cfg), "us": None,
                                "config": f"{cfg} failed: {type(e).__name__}: {str(e)[:80]}"})
                    continue
                timed.append((us, cfg))
                if rows == 1 and cfg == gemv.fixed_config(1, gated, dtype, dtype, k):
                    one_row_us = us
            timed.sort(key=lambda t: t[0])  # fastest first
            for i, (us, cfg) in enumerate(timed):
                tags = [t for t in (marks.get(cfg), "best" if i == 0 else None) if t]
                out.append({"op": name + (" +SwiGLU" if gated else ""), "shape": f"B={rows} N={n} K={k}",
                            "rows": rows, "impl": loop_name(cfg), "us": us, "bytes": nbytes,
                            "GBps": nbytes / us / 1e3, "pct_read_bw": 100.0 * nbytes / us / 1e3 / read_gbps,
                            "speedup": one_row_us / us if one_row_us else None, "tags": tags,
                            "config": (f"**{', '.join(tags)}** " if tags else "") + label(cfg)})
        del w, copies
        torch.cuda.empty_cache()
    return out


def run_fp8_gemv_sweep(device: str = "cuda", iters: int = 20,
                       shapes: dict[str, tuple[int, int, bool]] | None = None) -> list[dict]:
    """One row of x against FP8 block-wise weights (128 x 128 blocks): every `fp8_gemv` candidate tile per shape, in
    `run_gemv_sweep`'s rows (rows = 1; "default" marks `fp8_gemv.default_config`'s tile; bytes: the e4m3 weight, its
    scales, x and the output)."""
    from orinfer.kernels import fp8_gemv
    from orinfer.kernels.fp8_block import fp8_block_quantize

    dev = torch.device(device)
    torch.manual_seed(0)
    read_gbps = read_bandwidth_gbps(dev)
    out: list[dict] = [{"op": "read bandwidth (x.sum, 4 GiB fp32)", "shape": "", "impl": "torch", "us": None,
                        "bytes": 4 * 2**30, "GBps": read_gbps, "pct_read_bw": 100.0}]
    block = (128, 128)
    for name, (n, k, gated) in (shapes or decode_shapes(preset("qwen3-8b"))).items():
        q, s = fp8_block_quantize(torch.randn(2 * n if gated else n, k, device=dev) * k ** -0.5, block)
        w_bytes = q.numel() + s.numel() * 4
        nbytes = w_bytes + (k + n) * 2
        copies = [(q, s)]
        x = torch.randn(1, k, device=dev).bfloat16()
        default = fp8_gemv.default_config(n, k, gated)
        timed = []
        for cfg in dict.fromkeys(fp8_gemv.CANDIDATES + [default]):
            def calls(count: int, cfg=cfg) -> list:
                copies.extend((q.clone(), s.clone()) for _ in range(count - len(copies)))
                return [lambda qc=qc, sc=sc: fp8_gemv.fp8_gemv(x, qc, sc, block, gated=gated, cfg=cfg)
                        for qc, sc in copies[:count]]
            timed.append((graph_us(calls, w_bytes, iters), cfg))
        timed.sort(key=lambda t: t[0])
        default_us = next(us for us, cfg in timed if cfg == default)
        for i, (us, cfg) in enumerate(timed):
            tags = [t for t in ("default" if cfg == default else None, "best" if i == 0 else None) if t]
            out.append({"op": name + (" +SwiGLU" if gated else ""), "shape": f"B=1 N={n} K={k}", "rows": 1,
                        "impl": "one-row FMA", "us": us, "bytes": nbytes, "GBps": nbytes / us / 1e3,
                        "pct_read_bw": 100.0 * nbytes / us / 1e3 / read_gbps, "speedup": default_us / us,
                        "tags": tags, "config": (f"**{', '.join(tags)}** " if tags else "")
                        + f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps}"})
        del q, s, copies
        torch.cuda.empty_cache()
    return out


def summary(rows: list[dict]) -> str:
    """Per shape and row count: the fastest config of each loop, and the two defaults, as us (% read bandwidth)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        if r.get("us") is not None and "rows" in r:
            groups.setdefault((r["op"], r["rows"]), []).append(r)
    loops = ("one-row FMA", "multi-row FMA", "DOT", "cuBLAS")

    def cell(r: dict | None, with_config: bool = True) -> str:
        if r is None:
            return ""
        cfg = r["config"].split("** ")[-1]
        return f"{r['us']:.1f} ({r['pct_read_bw']:.0f}%)" + (f" {cfg}" if with_config and cfg != "-" else "")

    lines = ["| op | rows | default | fma default | " + " | ".join(f"best {loop}" for loop in loops) + " |",
             "| --- | ---: | --- | --- | " + " | ".join("---" for _ in loops) + " |"]
    for (op, n_rows), group in groups.items():
        tagged = {tag: r for r in group for tag in r["tags"]}
        best = [next((r for r in group if r["impl"] == loop), None) for loop in loops]  # the group is sorted
        lines.append(f"| {op} | {n_rows} | {cell(tagged.get('default'))} | {cell(tagged.get('fma default'))} | "
                     + " | ".join(cell(r) for r in best) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="qwen3-8b", help="whose shapes (a dense preset of orinfer bench --synthetic)")
    p.add_argument("--lm-head", action="store_true", help="also the lm_head (vocab x hidden)")
    p.add_argument("--rows", default="1,2,4,8", help="comma-separated row counts of x (1..16)")
    p.add_argument("--fp8", action="store_true", help="FP8 block-wise weights: the one-row `fp8_gemv` tiles (rows 1)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="one GPU's share of each matrix under tensor parallelism of size N")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--out", help="also write gemv-sweep.md (the table) and gemv-sweep.json (the rows) in this folder")
    args = p.parse_args(argv)
    rows_list = tuple(int(r) for r in args.rows.split(",") if r)
    if not rows_list or not all(1 <= r <= 16 for r in rows_list):
        p.error("--rows takes row counts between 1 and 16")
    if not torch.cuda.is_available():
        print("the GEMV sweep needs a CUDA device")
        return 1
    shapes = decode_shapes(preset(args.preset), args.lm_head, args.tensor_parallel_size)
    if args.fp8:
        rows, args.rows = run_fp8_gemv_sweep(args.device, args.iters, shapes), "1"
    else:
        rows = run_gemv_sweep(args.device, rows_list, args.iters, shapes)
    out = (lambda ext: os.path.join(args.out, f"gemv-sweep.{ext}")) if args.out else (lambda ext: None)
    table = (summary(rows) + "\n\nEvery config, fastest first per shape and row count:\n\n"
             + markdown(rows, speedup="vs 1 row (1-row default us / us)"))
    weights = "FP8 128x128 blocks" if args.fp8 else "bf16"
    share = f", one GPU's share at TP{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    report(rows, table, f"GEMV configs on {{device}} ({args.preset} shapes{share}, {weights}, rows {args.rows}; torch "
           f"{torch.__version__})", args.device, args.json or out("json"), out("md"), torch=torch.__version__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
