#!/usr/bin/env bash
# Device call: the failing GPU tests in full, then AWQ vs bf16 benchmarks (Qwen3-8B shapes).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/test_awq.py -k every_candidate > "$OUT/awq_candidates.txt" 2>&1
CUDA_LAUNCH_BLOCKING=1 python3 -m pytest -q -x -m gpu tests/test_vision_kernels.py -k "attention" > "$OUT/vision_attn.txt" 2>&1
tail -3 "$OUT/awq_candidates.txt" "$OUT/vision_attn.txt"
python3 -m orinfer bench --synthetic qwen3-8b --quant awq --batch-sizes 1,16 --prompt-lens 512,2048 --out "$OUT" 2>&1 | grep -v "^INFO" | tail -25
python3 -m orinfer bench --synthetic qwen3-8b --batch-sizes 1,16 --prompt-lens 2048 --out "$OUT/bf16" 2>&1 | grep -v "^INFO" | tail -14
