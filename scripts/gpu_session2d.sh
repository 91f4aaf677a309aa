#!/usr/bin/env bash
# Device call: Qwen3-VL benchmark (vision tower vs HF, text-only speed) and the VL tests on the GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m orinfer bench --synthetic qwen3-vl-8b --image-size 1024x768 --batch-sizes 1 --prompt-lens 2048 \
    --out "$OUT" > "$OUT/bench_vl.txt" 2>&1; grep "^|\|Ceil" "$OUT/bench_vl.txt" || tail -n 20 "$OUT/bench_vl.txt"
python3 -m orinfer bench --synthetic qwen3-8b --batch-sizes 1 --prompt-lens 2048 --out "$OUT/text" \
    > "$OUT/bench_text.txt" 2>&1; grep "decode\|prefill" "$OUT/bench_text.txt"
timeout 240 python3 -m pytest -q tests/test_vl_model.py tests/test_vl_engine.py tests/test_vision_kernels.py \
    > "$OUT/vl_tests.txt" 2>&1; tail -n 3 "$OUT/vl_tests.txt"
