#!/usr/bin/env bash
# Device call (session 5): the register-unpack W4 MMA in the engine. Its codegen check and the W4/AWQ/engine GPU
# tests, then AWQ and bf16 benchmarks in one call and the AWQ memory figure (scripts/gpu_session4b.sh does both).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ timeout 60 python3 -m pytest -q tests/test_w4_codegen.py 2>&1 | tail -n 2
  timeout 360 python3 -m pytest -q -m gpu tests/test_w4.py tests/test_awq.py tests/test_gpu_engine.py 2>&1; } \
    > "$OUT/gpu_tests.txt"; tail -n 6 "$OUT/gpu_tests.txt"
SKIP_TESTS=1 bash scripts/gpu_session4b.sh
