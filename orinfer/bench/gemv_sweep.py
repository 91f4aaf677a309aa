"""Every GEMV config on a model's decode shapes (default Qwen3-8B) at 1, 2, 4 and 8 rows of x (bf16): one-row FMA (1 row), multi-row FMA
(kernels/gemv_rows.py), tensor-core DOT and cuBLAS, each timed alone, for choosing the defaults of kernels/gemv.py.

Shapes (`--preset`, the `orinfer bench --synthetic` names; Qwen3-8B's in brackets): qkv [6144x4096], o [4096x4096],
the fused gate_up + SwiGLU [2x12288x4096] (gated configs; cuBLAS = GEMM + silu_and_mul), down [4096x12288] and, with
`--lm-head`, the lm_head [151936x4096]. Each row reports us, GB/s and % of the read bandwidth measured in the same run (bytes:
the weight once, x and the output), "vs 1 row": the 1-row default's time on the shape over this time (1.00 = as
cheap as one row), and which config each loop's default is ("default": what `gemv` runs today; "fma default": what
ORINFER_GEMV_FEW_ROWS=fma runs). Timing as bench/fp8_kernels.py: the calls over enough copies of the weight (4x L2)
captured in one CUDA graph, so every call reads its weight from HBM; median of --iters replays per call.

Run: `python -m orinfer.bench.gemv_sweep [--preset qwen3-0.6b] [--lm-head] [--rows 1,2,4,8] [--iters 20] [--out DIR]
[--json FILE]` (needs a CUDA device;
importing this module does not); --out writes DIR/gemv-sweep.md and DIR/gemv-sweep.json.
"""

from __future__ import annotations

import argparse
import os

import torch

from orinfer.bench.fp8_kernels import graph_us
from orinfer.bench.kernels import markdown, read_bandwidth_gbps, report
from orinfer.config import ModelConfig, preset


def decode_shapes(cfg: ModelConfig, lm_head: bool = False) -> dict[str, tuple[int, int, bool]]:
    """A dense model's decode GEMVs: name -> (outputs N, K, gated: the weight is [2N, K])."""
    q = cfg.num_attention_heads * cfg.head_dim
    shapes = {"qkv": (q + 2 * cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size, False),
              "o": (cfg.hidden_size, q, False), "gate_up": (cfg.intermediate_size, cfg.hidden_size, True),
              "down": (cfg.hidden_size, cfg.intermediate_size, False)}
    if lm_head:
        shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size, False)
    return shapes


def loop_name(cfg) -> str:
    from orinfer.kernels import gemv

    if cfg == gemv.CUBLAS:
        return "cuBLAS"
    return "DOT" if cfg.use_dot else "multi-row FMA" if cfg.multi_row else "one-row FMA"


def label(cfg) -> str:
    """A config as BLOCK_N x BLOCK_K, warps, stages ("-" for cuBLAS)."""
    return "-" if cfg.block_n == 0 else f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"


def configs(rows: int, gated: bool, k: int | None = None) -> list:
    """The candidates of every loop that can run `rows` rows (`tuning_plan`'s, plus the fixed defaults)."""
    from orinfer.kernels import gemv

    multi = gemv.ROWS_CONFIGS_GATED if gated else gemv.ROWS_CONFIGS
    cands = (gemv.FMA_CONFIGS if rows == 1 else []) + (multi if rows <= gemv.MAX_FMA_ROWS else [])
    cands += gemv.DOT_CONFIGS + [gemv.CUBLAS]
    default = gemv.fixed_config(rows, gated, torch.bfloat16, torch.bfloat16, k)
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
            marks = {gemv.fixed_config(rows, gated, dtype, dtype, k): "default"}
            if 2 <= rows <= gemv.MAX_FMA_ROWS:
                marks[gemv.FEW_ROWS_FMA_GATED if gated else gemv.FEW_ROWS_FMA] = "fma default"
            timed = []
            for cfg in configs(rows, gated, k):
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
    cfg = preset(args.preset)
    if cfg.num_experts:
        p.error(f"{args.preset} is a mixture of experts; the sweep takes dense presets (qwen3-0.6b, qwen3.5-27b, ...)")
    rows = run_gemv_sweep(args.device, rows_list, args.iters, decode_shapes(cfg, args.lm_head))
    out = (lambda ext: os.path.join(args.out, f"gemv-sweep.{ext}")) if args.out else (lambda ext: None)
    table = (summary(rows) + "\n\nEvery config, fastest first per shape and row count:\n\n"
             + markdown(rows, speedup="vs 1 row (1-row default us / us)"))
    report(rows, table, f"GEMV configs on {{device}} ({args.preset} shapes, bf16, rows {args.rows}; torch "
           f"{torch.__version__})", args.device, args.json or out("json"), out("md"), torch=torch.__version__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
