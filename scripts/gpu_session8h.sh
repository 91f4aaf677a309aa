#!/usr/bin/env bash
# Device call (session 8, final code): GPU tests of the kernels this session touched (W4 GEMV, norms, RoPE, KV store,
# decode attention), the batch-1 AWQ step, then the AWQ and bf16 benchmarks (scripts/gpu_session4b.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
timeout 150 python3 -m pytest -q -m "gpu or not gpu" tests/test_w4.py -k "gemv" -x 2>&1 | tail -n 1
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels.py -k "rms or rope or store or combine or decode or paged" \
    2>&1 | tail -n 1
timeout 120 python3 scripts/decode_overhead.py --quant awq 2>&1 | grep replay
SKIP_TESTS=1 bash scripts/gpu_session4b.sh
