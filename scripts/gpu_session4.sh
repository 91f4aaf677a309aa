#!/usr/bin/env bash
# Device call (session 4): split-K W4 MMA (GPU tests + a sweep at 1 and 16 rows against the default GEMV), then the
# serving benchmark with the load generator in its own process and uvloop (wheels carried in build/wheels).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 240 python3 -m pytest -q -m gpu tests/test_w4.py > "$OUT/gpu_tests.txt" 2>&1; tail -n 4 "$OUT/gpu_tests.txt"
fi
if [ -z "${SKIP_SWEEP:-}" ]; then
    W4_SWEEP_GEMV=default timeout 300 python3 scripts/w4_sweep.py ${SWEEP_ROWS:-1 16} > "$OUT/w4_sweep.md" 2> "$OUT/w4_sweep.err"
    grep "^| " "$OUT/w4_sweep.md" | tail -n 60
fi
if [ -z "${SKIP_SERVE:-}" ]; then
    python3 -m pip install -q --no-index --find-links build/wheels --target /tmp/pydeps fastapi uvicorn httpx uvloop \
        > /dev/null 2>&1
    export PYTHONPATH=$PWD:$PWD/scripts:/tmp/pydeps
    timeout 300 python3 scripts/bench_serve_synthetic.py --synthetic qwen3-8b --concurrency 1 8 64 --max-tokens 128 \
        --out "$OUT/serve-qwen3-8b-bfloat16.json" > "$OUT/serve.txt" 2>&1; grep -v "^INFO" "$OUT/serve.txt" | tail -12
fi
