#!/usr/bin/env bash
# Device call (session 5, first): W4/AWQ GPU tests with the register-unpack MMA, then the A/B timing script.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/test_w4.py -x 2>&1 | tail -15 | tee "$OUT/tests.txt"
timeout 330 python3 scripts/w4_ab.py "$@" 2>"$OUT/ab_err.txt" | tee "$OUT/ab.txt"
tail -20 "$OUT/ab_err.txt"
