#!/usr/bin/env bash
# Device call (session 3): W4 INT4 kernels + lookahead decode + server images. GPU tests, then the AWQ and bf16
# benchmarks (same process ceilings each) and the AWQ memory figure with a 4096-token KV cache (run 24).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 300 python3 -m pytest -q -m gpu tests/test_w4.py tests/test_awq.py tests/test_gpu_engine.py \
    > "$OUT/gpu_tests.txt" 2>&1; tail -n 4 "$OUT/gpu_tests.txt"
timeout 200 python3 -m pytest -q tests/test_lookahead.py > "$OUT/lookahead_tests.txt" 2>&1; tail -n 2 "$OUT/lookahead_tests.txt"
python3 -m orinfer bench --synthetic qwen3-8b --quant awq --out "$OUT/awq" > "$OUT/bench_awq.txt" 2>&1
grep "^|\|Ceil\|roofline" "$OUT/bench_awq.txt" || tail -n 20 "$OUT/bench_awq.txt"
python3 -m orinfer bench --synthetic qwen3-8b --quant awq --kv-tokens 4096 --out "$OUT/awq4k" \
    > "$OUT/bench_awq4k.txt" 2>&1; grep "memory\|Note" "$OUT/bench_awq4k.txt" || tail -n 20 "$OUT/bench_awq4k.txt"
python3 -m orinfer bench --synthetic qwen3-8b --out "$OUT/bf16" > "$OUT/bench_bf16.txt" 2>&1
grep "^|\|Ceil" "$OUT/bench_bf16.txt" || tail -n 20 "$OUT/bench_bf16.txt"
python3 -m orinfer bench --synthetic qwen3-8b --no-async-scheduling --batch-sizes 1 --prompt-lens 512 \
    --out "$OUT/bf16_sync" > "$OUT/bench_bf16_sync.txt" 2>&1; grep "decode" "$OUT/bench_bf16_sync.txt"
