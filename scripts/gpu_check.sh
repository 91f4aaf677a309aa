#!/usr/bin/env bash
# One device call: GPU tests, the engine benchmark against HF transformers, the kernel micro-benchmark.
# Usage on the device machine: bash scripts/gpu_check.sh [tests|bench|kernels|all]   (logs and results under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 300 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_engine.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [ "$what" = kernels ] || [ "$what" = all ]; then
  timeout 90 python3 -m orinfer.bench.kernels 2>&1 | tee "$OUT/kernels.md" | tail -20
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 240 python3 -m orinfer --log-level INFO bench --synthetic qwen3-8b --compare-hf --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -30
fi
