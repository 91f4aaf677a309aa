#!/usr/bin/env bash
# Device call (session 6): the KV store fused into QK-norm + RoPE. Kernel and engine GPU tests, the batch-1 decode
# step for AWQ and bf16, then the AWQ and bf16 benchmarks (scripts/gpu_session4b.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ timeout 60 python3 -m pytest -q tests/test_w4_codegen.py 2>&1 | tail -n 2
  timeout 200 python3 -m pytest -q -m "gpu or not gpu" tests/test_kernels.py -k "qk_norm_rope or store_kv or decode" 2>&1 | tail -n 2
  timeout 300 python3 -m pytest -q -m gpu tests/test_w4.py tests/test_awq.py tests/test_gpu_engine.py tests/test_vl_engine.py 2>&1 | tail -n 3; } \
    > "$OUT/gpu_tests.txt"; cat "$OUT/gpu_tests.txt"
for q in "--quant awq" ""; do
    echo "decode step $q"; timeout 150 python3 scripts/decode_overhead.py $q 2>&1 | tail -3 | head -2
done
SKIP_TESTS=1 bash scripts/gpu_session4b.sh
