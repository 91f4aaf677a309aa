"""Compile the one-row W4 GEMV for sm_90 on any machine (no GPU needed: Triton ships ptxas and cuobjdump) and print
its registers, the SASS instruction mix per weight (the count behind docs/performance.md's session 6 notes), and the
order in which its loads are issued (`load_order`: session 20 found ptxas sinking half of each program's weight loads
below the first dot products, and that issuing them all at once measured slower).
Usage: python3 scripts/sass_mix.py [BLOCK_N BLOCK_KP WARPS] [gated] [down] [int] [words] [preload]   (defaults: the
module's default tile for the row length; `down`: K = 12288 instead of 4096; `int`: the dp2a step; `words`: the dp2a
step on an RMSNorm's words; `preload`: first tiles before the PDL wait)."""

from __future__ import annotations

import argparse
import collections
import itertools
import re

from orinfer.kernels import sm90, w4_gemv


def compile_gemv(block_n: int, block_kp: int, warps: int, gated: bool, k8: int = 512, **flags: bool
                 ) -> tuple[str, str]:
    """(cuobjdump -sass text, -res-usage text) of the kernel for K = 8 * k8 (Qwen3-8B: 4096, down 12288), group 128;
    `flags`: `w4_gemv.compile_sm90`'s integer / words / rms / preload."""
    return sm90.sass(w4_gemv.compile_sm90(block_n, block_kp, warps, gated, k8, **flags))


opcodes = sm90.opcodes   # the listing's opcodes with their modifiers (LDG.E.EF.128, IDP.2A.LO.S16.U8, ...), in order


def opcode_mix(sass: str) -> collections.Counter:
    return sm90.mix(opcodes(sass))


def load_order(sass: str) -> str:
    """The kernel's loads and dot products in issue order, runs counted: W a weight load (the evict-first loads),
    L any other global load, ACQ the PDL wait, IDP dp2a, FFM fp32 FMA, STG the store."""
    tags = ["W" if ".EF" in op else "L" if op.startswith("LDG") else op[:3] for op in opcodes(sass)
            if op.startswith(("LDG", "ACQBULK", "IDP", "FFMA", "STG"))]
    return " ".join(f"{tag}x{len(list(run))}" for tag, run in itertools.groupby(tags))


OPTIONS = ("gated", "down", "int", "words", "preload")


def parse_args(argv: list[str] | None = None) -> tuple[tuple[int, int, int] | None, set[str]]:
    """(the tile (BLOCK_N, BLOCK_KP, WARPS) or None for the default, the options named)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", metavar="BLOCK_N BLOCK_KP WARPS | " + " | ".join(OPTIONS))
    args = p.parse_args(argv)
    nums = [int(a) for a in args.items if a.isdigit()]
    options = {a for a in args.items if not a.isdigit()}
    if len(nums) not in (0, 3) or not options <= set(OPTIONS):
        p.error(f"give three numbers (BLOCK_N BLOCK_KP WARPS) or none, and options among {', '.join(OPTIONS)}")
    return (tuple(nums) if nums else None), options


def main(argv: list[str] | None = None) -> None:
    tile, options = parse_args(argv)
    k8 = 1536 if "down" in options else 512
    cfg = w4_gemv.DEFAULT_GEMV if k8 <= w4_gemv.DEFAULT_GEMV.block_kp else w4_gemv.DEFAULT_GEMV_LONG_ROWS
    block_n, block_kp, warps = tile or cfg[:3]
    gated = "gated" in options
    words = "words" in options
    flags = dict(integer="int" in options, words=words, rms=words, preload="preload" in options)
    sass, usage = compile_gemv(block_n, block_kp, warps, gated, k8, **flags)
    mix = opcode_mix(sass)
    weights = block_n * k8 * 8 * (2 if gated else 1) / (32 * warps)   # per thread, whole kernel
    regs = re.search(r"REG:\d+", usage).group(0)
    print(f"config ({block_n}, {block_kp}, {warps}){' gated' if gated else ''} "
          f"{' '.join(k for k, v in flags.items() if v)}: "
          f"{regs}, {sum(mix.values())} SASS instructions for {weights:.0f} weights "
          f"per thread = {sum(mix.values()) / weights:.2f} per weight")
    print(", ".join(f"{op} {n}" for op, n in mix.most_common(16)))
    print("issue order:", load_order(sass))


if __name__ == "__main__":
    main()
