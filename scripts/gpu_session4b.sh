#!/usr/bin/env bash
# Device call (session 4): the swap-AB split-K W4 MMA in the engine. GPU tests of the W4/AWQ kernels and the GPU
# engine, then AWQ and bf16 benchmarks in one call (batch 16 against batch 16), and the AWQ memory figure with a
# 4096-token KV cache. Writes at most 7 files under $OUT (the device returns 8).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 360 python3 -m pytest -q -m gpu tests/test_w4.py tests/test_awq.py tests/test_gpu_engine.py \
        > "$OUT/gpu_tests.txt" 2>&1; tail -n 4 "$OUT/gpu_tests.txt"
fi
python3 -m orinfer bench --synthetic qwen3-8b --quant awq --batch-sizes 1,8,16,32,64 --out "$OUT/awq" 2>&1 \
    | grep "^|\|Ceil\|roofline"
python3 -m orinfer bench --synthetic qwen3-8b --quant awq --kv-tokens 4096 --out "$OUT/awq4k" 2>&1 \
    | grep "decode\|memory\|Note"
python3 -m orinfer bench --synthetic qwen3-8b --batch-sizes 1,8,16,32,64 --out "$OUT/bf16" 2>&1 \
    | grep "^|\|Ceil\|roofline"
