#!/usr/bin/env bash
# Device call (session 6): W4 GPU tests, the one-row GEMV A/B (scripts/w4_gemv_ab.py), the AWQ batch-1 decode step
# (graph replay vs engine step).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest -q -m "gpu or not gpu" tests/test_w4.py -k "gemv or linear or gate_up" -x 2>&1 | tail -3 | tee "$OUT/tests.txt"
timeout 200 python3 scripts/w4_gemv_ab.py "$@" 2>"$OUT/ab_err.txt" | tee "$OUT/ab.txt"
tail -5 "$OUT/ab_err.txt"
timeout 150 python3 scripts/decode_overhead.py --quant awq 2>&1 | tail -3 | tee "$OUT/overhead_awq.txt"
