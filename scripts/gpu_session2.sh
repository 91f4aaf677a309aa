#!/usr/bin/env bash
# Device call: GPU tests of AWQ and the vision kernels, then the synthetic serving benchmark (Qwen3-8B shapes).
# Needs the server's wheels carried in build/wheels (pip download fastapi uvicorn httpx for the device's python).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links build/wheels --target /tmp/pydeps fastapi uvicorn httpx 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/pydeps
python3 -m pytest -q -m gpu tests/test_awq.py tests/test_vision_kernels.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
timeout 300 python3 scripts/bench_serve_synthetic.py --synthetic qwen3-8b --concurrency 1 8 64 --max-tokens 128 \
    --out "$OUT/serve-qwen3-8b-bfloat16.json" 2>&1 | grep -v "^INFO" | tail -12
