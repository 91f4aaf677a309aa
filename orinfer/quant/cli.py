"""Command-line pieces: `orinfer quantize IN_DIR OUT_DIR --method awq|rtn` and `orinfer export IN_DIR OUT.bin`.

orinfer/cli.py registers them with `add_quantize_parser(sub)` and `add_export_parser(sub)`; each sets `func`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from orinfer.errors import ConfigError


def add_quantize_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("quantize", help="quantize a HF model directory to AWQ INT4 (W4A16, AutoAWQ format)")
    p.add_argument("in_dir", help="Hugging Face model directory (fp32/bf16/fp16)")
    p.add_argument("out_dir", help="where to write the AWQ checkpoint")
    p.add_argument("--method", default="awq", choices=["awq", "rtn"],
                   help="awq: activation-aware scale + clip search on calibration text; rtn: round to nearest")
    p.add_argument("--group-size", type=int, default=128, help="input channels per scale/zero (default 128)")
    p.add_argument("--calib", default=None, help="calibration text file (default: the bundled corpus)")
    p.add_argument("--calib-tokens", type=int, default=65536, help="calibration tokens at most (default 65536)")
    p.add_argument("--seq-len", type=int, default=512, help="calibration sequence length (default 512)")
    p.add_argument("--n-grid", type=int, default=20, help="grid points of the alpha and clip searches")
    p.add_argument("--no-clip", action="store_true", help="awq: skip the clipping search")
    p.add_argument("--device", default=None, help="device for the search (default: cuda if available)")
    p.set_defaults(func=run_quantize)
    return p


def run_quantize(args: argparse.Namespace) -> int:
    from orinfer.quant.checkpoint import quantize_checkpoint

    calib_text = None
    if args.calib is not None:
        try:
            calib_text = Path(args.calib).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read calibration text {args.calib}: {exc}") from None
    report = quantize_checkpoint(args.in_dir, args.out_dir, method=args.method, group_size=args.group_size,
                                 calib_text=calib_text, n_grid=args.n_grid, clip=not args.no_clip,
                                 device=args.device, seq_len=args.seq_len, max_calib_tokens=args.calib_tokens)
    extra = ""
    if "alphas" in report:
        alphas = list(report["alphas"].values())
        extra = f", mean alpha {sum(alphas) / len(alphas):.2f} over {len(alphas)} searches"
    print(f"wrote {args.method} INT4 (group {args.group_size}) to {report['out_dir']}: "
          f"{report['bytes'] / 2**20:.1f} MiB in {report['seconds']:.1f} s{extra}")
    return 0


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a Qwen3 directory (AWQ or 16-bit) as one seed-format .bin file")
    p.add_argument("in_dir", help="Hugging Face Qwen3 directory (AWQ -> version 5, else the FP16 variant)")
    p.add_argument("out_path", help="output .bin file")
    p.set_defaults(func=run_export)
    return p


def run_export(args: argparse.Namespace) -> int:
    from orinfer.loader.seed_bin import export_bin

    info = export_bin(args.in_dir, args.out_path)
    print(f"wrote {info['path']} (version {info['version']}, {info['bytes'] / 2**20:.1f} MiB)")
    return 0
