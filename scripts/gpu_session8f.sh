#!/usr/bin/env bash
# Device call (session 8, final code): GPU tests of the W4/AWQ kernels, the decode kernels and the GPU engine, then the
# batch-1 AWQ step (graph replay). The benchmarks follow in a second call: SKIP_TESTS=1 bash scripts/gpu_session4b.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
timeout 300 python3 -m pytest -q -m gpu tests/test_w4.py tests/test_awq.py tests/test_gpu_engine.py 2>&1 | tail -n 1
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_vl_engine.py 2>&1 | tail -n 1
timeout 120 python3 scripts/decode_overhead.py --quant awq 2>&1 | tail -3
