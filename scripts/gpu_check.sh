#!/usr/bin/env bash
# The GPU check: every `gpu`-marked test, the kernel micro-benchmark, and the engine benchmarks (bf16 against HF
# transformers, then AWQ INT4), on random Qwen3-8B weights. Logs and results go under $OUT (default: out/).
#
# Usage on the device machine, from anywhere: bash scripts/gpu_check.sh [tests|kernels|bench|all]
#   tests    python3 -m pytest -q -m gpu tests/              (at most 9 minutes)
#   kernels  python3 -m orinfer.bench.kernels                (at most 2.5 minutes; the MoE rows included)
#   bench    orinfer bench --synthetic qwen3-8b --compare-hf, then the same with --quant awq (at most 4.5 minutes
#            each; both write their JSON and markdown into $OUT under different names)
# Each part fits one 10-minute device call; `all` (the default) runs the three in turn and needs about 20 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${1:-all}
case $what in tests|kernels|bench|all) ;; *) echo "usage: $0 [tests|kernels|bench|all]" >&2; exit 2;; esac
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 540 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [ "$what" = kernels ] || [ "$what" = all ]; then
  timeout 150 python3 -m orinfer.bench.kernels 2>&1 | tee "$OUT/kernels.md" | tail -20
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 270 python3 -m orinfer --log-level INFO bench --synthetic qwen3-8b --compare-hf --out "$OUT" 2>&1 \
    | tee "$OUT/bench.log" | tail -30
  timeout 270 python3 -m orinfer --log-level INFO bench --synthetic qwen3-8b --quant awq --out "$OUT" 2>&1 \
    | tee "$OUT/bench_awq.log" | tail -30
fi
