#!/usr/bin/env bash
# Device call (session 10, final tree, run 109): every GPU-marked test, one log per file under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for f in test_w4 test_awq test_kernels test_gpu_engine test_lookahead test_vision_kernels test_vision_graphs; do
    timeout 300 python3 -m pytest -q -m gpu "tests/$f.py" > "$OUT/$f.txt" 2>&1
    echo "$f (exit $?): $(tail -n 1 "$OUT/$f.txt")"
done
