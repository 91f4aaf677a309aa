"""Compile the one-row W4 GEMV for sm_90 on any machine (no GPU needed: Triton ships ptxas and cuobjdump) and print
its registers and the SASS instruction mix per weight, the count behind docs/performance.md's session 6 notes.
Usage: python3 scripts/sass_mix.py [BLOCK_N BLOCK_KP WARPS] [gated] [down]   (defaults: the module's default tile for
the row length; `down`: K = 12288 instead of 4096)."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton

from orinfer.kernels import w4_gemv

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_gemv(block_n: int, block_kp: int, warps: int, gated: bool, k8: int = 512) -> tuple[str, str]:
    """(cuobjdump -sass text, -res-usage text) of the kernel for K = 8 * k8 (Qwen3-8B: 4096, down 12288), group 128."""
    compiled = w4_gemv.compile_sm90(block_n, block_kp, warps, gated, k8)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        run = [os.path.join(BIN, "cuobjdump")]
        sass = subprocess.run(run + ["-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run(run + ["-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return sass, usage


def opcode_mix(sass: str) -> collections.Counter:
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return collections.Counter(ops)


def main() -> None:
    k8 = 1536 if "down" in sys.argv else 512
    cfg = w4_gemv.DEFAULT_GEMV if k8 <= w4_gemv.DEFAULT_GEMV.block_kp else w4_gemv.DEFAULT_GEMV_LONG_ROWS
    nums = [int(a) for a in sys.argv[1:] if a.isdigit()]
    block_n, block_kp, warps = nums if len(nums) == 3 else cfg
    gated = "gated" in sys.argv
    sass, usage = compile_gemv(block_n, block_kp, warps, gated, k8)
    mix = opcode_mix(sass)
    weights = block_n * k8 * 8 * (2 if gated else 1) / (32 * warps)   # per thread, whole kernel
    regs = re.search(r"REG:\d+", usage).group(0)
    print(f"config ({block_n}, {block_kp}, {warps}){' gated' if gated else ''}: "
          f"{regs}, {sum(mix.values())} SASS instructions for {weights:.0f} weights "
          f"per thread = {sum(mix.values()) / weights:.2f} per weight")
    print(", ".join(f"{op} {n}" for op, n in mix.most_common(16)))


if __name__ == "__main__":
    main()
