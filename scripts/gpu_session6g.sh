#!/usr/bin/env bash
# Device call (session 6, last): default one-row GEMV tile (16, 512, 4). W4 kernel tests on the GPU (all of
# test_w4.py), then the AWQ and bf16 benchmarks (scripts/gpu_session4b.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -m "gpu or not gpu" tests/test_w4.py -x 2>&1 | tail -n 2 | tee "$OUT/gpu_tests.txt"
timeout 120 python3 scripts/decode_overhead.py --quant awq 2>&1 | tail -3 | head -2
SKIP_TESTS=1 bash scripts/gpu_session4b.sh
