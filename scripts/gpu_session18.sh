#!/usr/bin/env bash
# Device calls (session 18): o's weights prefetched into L2 from a side stream (kernels/l2_prefetch.py) and the
# graphs' argmax writing the ids into pinned host memory. PARTS picks what runs:
#   tests  the GPU tests of the changed code (argmax, L2 prefetch, engine, lookahead, AWQ, VL, words)
#   fresh  batch-1 step replay in fresh engines, AWQ and bf16, with the prefetch on and off (ROUNDS times)
#   wait   one sequence in the bench's 64-sequence engine (scripts/host_wait.py)
#   bench  the official AWQ and bf16 benchmarks (scripts/gpu_session4b.sh without its tests)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-tests fresh wait}
OFF='from orinfer.layers import linear, awq_linear
linear.Linear.decode_weights = awq_linear.AWQLinear.decode_weights = lambda self: ()'
if [[ $PARTS == *tests* ]]; then
    timeout 300 python3 -m pytest -q -m gpu tests/test_argmax.py tests/test_l2_prefetch.py tests/test_gpu_engine.py \
        tests/test_lookahead.py tests/test_w4_words.py > $OUT/tests_engine.txt 2>&1
    echo "engine tests (exit $?): $(tail -n 1 $OUT/tests_engine.txt)"
    timeout 240 python3 -m pytest -q -m gpu tests/test_awq.py tests/test_vl_engine.py tests/test_vision_graphs.py \
        > $OUT/tests_awq_vl.txt 2>&1
    echo "AWQ + VL tests (exit $?): $(tail -n 1 $OUT/tests_awq_vl.txt)"
fi
if [[ $PARTS == *fresh* ]]; then
    for round in $(seq 1 ${ROUNDS:-1}); do
        for quant in awq bf16; do
            args=$([[ $quant == awq ]] && echo "--quant awq" || echo "--bf16")
            for v in on off; do
                patch=$([[ $v == on ]] && echo "" || echo "$OFF")
                result=$(timeout 120 python3 scripts/step_ab.py "$patch" $args 2>&1 | grep -i 'replay\|error')
                echo "round $round $quant prefetch $v: $result"
            done
        done
    done
fi
if [[ $PARTS == *wait* ]]; then
    timeout 150 python3 scripts/host_wait.py 64 2>&1 | grep "tok/s\|device\|rror"
fi
if [[ $PARTS == *bench* ]]; then
    SKIP_TESTS=1 bash scripts/gpu_session4b.sh
fi
