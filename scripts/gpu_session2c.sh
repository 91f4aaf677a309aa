#!/usr/bin/env bash
# Device call: vision/AWQ GPU tests, the Qwen3-VL benchmark (vision tower vs HF, text-only speed vs Qwen3-8B) and the
# kernel micro-benchmark. Full logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/test_vision_kernels.py > "$OUT/gpu_vision_kernels.txt" 2>&1; tail -n 2 "$OUT/gpu_vision_kernels.txt"
python3 -m pytest -q -m gpu tests/test_awq.py -k every_candidate > "$OUT/gpu_awq.txt" 2>&1; tail -n 2 "$OUT/gpu_awq.txt"
python3 -m orinfer bench --synthetic qwen3-vl-8b --image-size 1024x768 --batch-sizes 1 --prompt-lens 2048 \
    --out "$OUT" > "$OUT/bench_vl.txt" 2>&1; grep "^|" "$OUT/bench_vl.txt" || tail -n 20 "$OUT/bench_vl.txt"
python3 -m orinfer bench --synthetic qwen3-8b --batch-sizes 1 --prompt-lens 2048 --out "$OUT/text" \
    > "$OUT/bench_text.txt" 2>&1; grep "^|" "$OUT/bench_text.txt" || tail -n 20 "$OUT/bench_text.txt"
timeout 120 python3 -m orinfer.bench.kernels > "$OUT/kernels.txt" 2>&1; grep -i "vision" "$OUT/kernels.txt" | head -12
timeout 200 python3 -m pytest -q -x tests/test_vl_model.py tests/test_vl_engine.py > "$OUT/vl_tests.txt" 2>&1; tail -n 3 "$OUT/vl_tests.txt"
