#!/usr/bin/env bash
# Device calls (session 14): x's int16 words made by their producers (kernels/w4_words.py). PARTS picks what runs:
#   tests  the words kernels and the W4 GEMV tests on CUDA, and the AWQ engine GPU tests
#   fresh  the batch-1 AWQ step in a fresh engine per variant (scripts/step_ab.py), ROUNDS times (default 1).
#          VARIANTS: "|"-separated "NAME=PYTHON" patches (default: words off, words on)
#   bench  the official AWQ and bf16 benchmarks (scripts/gpu_session4b.sh without its tests)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-tests fresh}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
if [[ $PARTS == *tests* ]]; then
    timeout 300 python3 -m pytest -q -m "gpu or not gpu" tests/test_w4_words.py > $OUT/test_w4_words.txt 2>&1
    echo "test_w4_words on CUDA (exit $?): $(tail -n 1 $OUT/test_w4_words.txt)"
    timeout 300 python3 -m pytest -q -m "gpu or not gpu" tests/test_w4.py -k "gemv" > $OUT/test_w4_gemv.txt 2>&1
    echo "test_w4 -k gemv on CUDA (exit $?): $(tail -n 1 $OUT/test_w4_gemv.txt)"
fi
if [[ $PARTS == *fresh* ]]; then
    W=orinfer.kernels.w4_words
    G=orinfer.kernels.w4_gemv
    IFS="|" read -ra VS <<< "${VARIANTS:-off=import $W as w; w.ENABLED = False|on=}"
    for round in $(seq 1 ${ROUNDS:-1}); do
        for v in "${VS[@]}"; do
            echo "round $round, ${v%%=*}: ${v#*=}"
            timeout 120 python3 scripts/step_ab.py "${v#*=}" 2>&1 | grep -i "replay\|error"
        done
    done
fi
if [[ $PARTS == *bench* ]]; then
    SKIP_TESTS=1 bash scripts/gpu_session4b.sh
fi
