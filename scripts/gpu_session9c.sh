#!/usr/bin/env bash
# Device call (session 9, final code): GPU tests of the changed kernels (W4 dequantisation, decode attention), decode
# attention at 32 against 33 splits, the batch-1 AWQ step, then the AWQ and bf16 benchmarks (scripts/gpu_session4b.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
timeout 150 python3 -m pytest -q -m gpu tests/test_w4.py tests/test_awq.py -k "dequant or prefill or linear" 2>&1 \
    | tail -n 1
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels.py -k "decode or paged or combine" 2>&1 | tail -n 1
timeout 100 python3 scripts/decode_attention_splits.py
timeout 120 python3 scripts/decode_overhead.py --quant awq 2>&1 | grep replay
SKIP_TESTS=1 bash scripts/gpu_session4b.sh
