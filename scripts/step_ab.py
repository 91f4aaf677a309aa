"""Batch-1 AWQ decode step (graph replay, scripts/decode_overhead.py) under a patch given as Python source, so that
kernel choices can be compared in the engine rather than in isolation. Usage (device):
python3 scripts/step_ab.py 'import orinfer.kernels.w4_gemv as m; m.DEFAULT_GEMV = m.W4GemvConfig(8, 512, 4)'
Further arguments go to decode_overhead.py instead of its default `--quant awq` (e.g. `--bf16`: any other word)."""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    patch = sys.argv[1] if len(sys.argv) > 1 else ""
    exec(patch, {})  # noqa: S102  (a developer's own A/B snippet)
    sys.argv = ["decode_overhead.py", *(sys.argv[2:] or ["--quant", "awq"])]
    runpy.run_path("scripts/decode_overhead.py", run_name="__main__")


if __name__ == "__main__":
    main()
