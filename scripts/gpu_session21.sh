#!/usr/bin/env bash
# Device calls (session 21). PARTS picks what runs:
#   fresh  the batch-1 AWQ step in a fresh engine per variant: scripts/gpu_session14.sh's (VARIANTS, ROUNDS)
#   tests  GPU tests named by TESTS (pytest arguments, default tests/test_w4.py), with `-m "gpu or not gpu"`
#   bench  the official AWQ and bf16 benchmarks (scripts/gpu_session4b.sh without its tests)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-fresh}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
if [[ $PARTS == *tests* ]]; then
    timeout 400 python3 -m pytest -q -m "gpu or not gpu" ${TESTS:-tests/test_w4.py} > $OUT/tests.txt 2>&1
    echo "tests (exit $?): $(tail -n 1 $OUT/tests.txt)"
    grep -E "FAILED|Error" $OUT/tests.txt | head -20
fi
if [[ $PARTS == *fresh* ]]; then
    VARIANTS=${VARIANTS:-base=} PARTS=fresh bash scripts/gpu_session14.sh | grep -v "^NVIDIA"
fi
if [[ $PARTS == *bench* ]]; then
    SKIP_TESTS=1 bash scripts/gpu_session4b.sh
fi
