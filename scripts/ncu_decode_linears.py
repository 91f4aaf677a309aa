"""A preset's decode linears in each weight form, called inside NVTX ranges for Nsight Compute to read the
kernels' hardware counters (DRAM throughput, waves, occupancy, warp stalls, issue rate): the data behind
docs/performance.md's "Batch-1 FP8 kernels under Nsight Compute" (NOTES run 429). Each linear runs twice, in
ranges `<op>-0` (compiles and tunes) and `<op>-1` (the one to profile).

Forms (random weights of each shape, as `orinfer.bench.fp8_kernels` makes them): `fp8` the FP8 block-wise dispatch,
`bf16` the 16-bit GEMV, `w8` GPTQ-Int8's W8 dispatch, at `--rows` rows of bf16 x (one row: decode at batch 1), and
`w8a8` x quantized then the W8A8 `fp8_gemm` at `--rows`. Without ncu it just runs the calls.

Usage (on a machine whose runtime lets ncu read counters, from the repo root):

    ncu --clock-control none --set full --import-source no --nvtx --nvtx-include "qkv-1/" --nvtx-include "o-1/" \\
        --nvtx-include "gate_up-1/" --nvtx-include "down-1/" python3 scripts/ncu_decode_linears.py
    python3 scripts/ncu_decode_linears.py --preset qwen3.5-35b-a3b --forms fp8 --rows 1
    python3 scripts/ncu_decode_linears.py --forms w8a8 --rows 64 --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse

import torch

FORMS = ("fp8", "bf16", "w8", "w8a8")


def run_calls(preset_name: str, forms: list[str], rows: int, tp: int) -> list[str]:
    """Calls each decode linear of the preset (one GPU's share at `tp`) in each form, twice, inside NVTX ranges named
    `<op>-<call>`; returns the ranges' names."""
    from orinfer.bench.fp8_kernels import BLOCK, W8_GROUP, Weights
    from orinfer.bench.gemv_sweep import decode_shapes
    from orinfer.config import preset
    from orinfer.kernels import activation, fp8_gemm, fp8_ops, gemv, w8_ops
    from orinfer.kernels.fp8_quant import fp8_quantize_act
    from orinfer.kernels.w8 import W8Weight

    dev = torch.device("cuda")
    torch.manual_seed(0)
    ranges = []
    for name, (n, k, gated) in decode_shapes(preset(preset_name), tp=tp).items():
        w = Weights(2 * n if gated else n, k, dev)
        x = torch.randn(rows, k, device=dev).bfloat16()
        for call in range(2):
            torch.cuda.nvtx.range_push(f"{name}-{call}")
            if "fp8" in forms:
                (fp8_ops.fp8_gate_up_silu if gated else fp8_ops.fp8_block_linear)(x, w.q, w.s, BLOCK)
            if "bf16" in forms:
                activation.fused_gate_up_silu(x, w.bf16) if gated else gemv.gemv(x, w.bf16)
            if "w8" in forms:
                (w8_ops.w8_gate_up_silu if gated else w8_ops.w8_linear)(x, W8Weight(*w.w8, 128, W8_GROUP))
            if "w8a8" in forms:
                xq, xs = fp8_quantize_act(x, 128)
                fp8_gemm.fp8_gemm(xq, xs[:rows], w.q, w.s, BLOCK, torch.bfloat16)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            ranges.append(f"{name}-{call}")
        del w
        torch.cuda.empty_cache()
    return ranges


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-8b", help="an `orinfer bench --synthetic` preset (default qwen3-8b)")
    p.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated, of {', '.join(FORMS)} (default: all)")
    p.add_argument("--rows", type=int, default=1, help="rows of x (default 1; w8a8 needs >= 1)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="one GPU's share of each linear at this size")
    args = p.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    unknown = sorted(set(forms) - set(FORMS))
    if unknown or args.rows < 1 or args.tensor_parallel_size < 1:
        p.error(f"unknown forms {unknown}" if unknown else "--rows and --tensor-parallel-size must be >= 1")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    ranges = run_calls(args.preset, forms, args.rows, args.tensor_parallel_size)
    print(f"ran {len(ranges)} ranges: {' '.join(ranges)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
