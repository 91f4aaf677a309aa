#!/usr/bin/env bash
# Device calls (session 13). PARTS picks what runs (default "preload seqs"):
#   preload  the one-row W4 GEMV's first weight tiles loaded before the PDL wait: the W4 kernel tests on CUDA, then
#            the batch-1 AWQ step per (tile, preload) variant (scripts/preload_ab.py)
#   seqs     why the engine built for 64 sequences replays the batch-1 graph slower: the same engine with a
#            warm-up prefill of 2048 tokens instead of 8192 (scripts/decode_graph_variants.py, one process each;
#            run 123)
#   kernels  per-kernel time in the batch-1 graph of engines built for 1 and 64 sequences, with PDL and without
#            (scripts/graph_kernel_times.py; tables under $OUT)
#   fresh    down's tile and preload A/B'd in fresh processes (scripts/step_ab.py), twice over: a recaptured graph can
#            replay ~0.1 ms slower or faster than one captured at engine build, whatever it runs (runs 124, 129)
#   bench    the official AWQ and bf16 benchmarks (scripts/gpu_session4b.sh without its tests)
#   graphs   the batch-1 graph's replay while other decode graphs are alive, and after (scripts/graph_count_ab.py)
#   order    engines for 1 and 64 sequences, and for 64 with the batch-1 kernels loaded first
#            (scripts/capture_order_ab.py, one process each)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-preload seqs}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
nvidia-smi dmon -s pc -d 5 > $OUT/dmon.txt 2>&1 &   # power, temperature and clocks through the run
DMON=$!
trap 'kill $DMON 2>/dev/null' EXIT
if [[ $PARTS == *preload* ]]; then
    if [[ -z ${SKIP_TESTS:-} ]]; then
        timeout 300 python3 -m pytest -q -m "gpu or not gpu" tests/test_w4.py -k "gemv" > $OUT/test_w4_gemv.txt 2>&1
        echo "test_w4 -k gemv on CUDA (exit $?): $(tail -n 1 $OUT/test_w4_gemv.txt)"
    fi
    timeout 100 python3 scripts/decode_overhead.py --quant awq 2>&1 | grep replay
    timeout 400 python3 scripts/preload_ab.py ${PRELOAD_VARIANTS:-} 2>&1 | grep -i "replay\|error"
fi
if [[ $PARTS == *kernels* ]]; then
    for pdl in 1 0; do
        for seqs in 1 64; do
            echo "PDL $pdl, $seqs sequences"
            ORINFER_PDL=$pdl timeout 150 python3 scripts/graph_kernel_times.py $seqs $OUT/kernels_${seqs}_pdl$pdl.json \
                > $OUT/kernels_${seqs}_pdl$pdl.txt 2>&1
            grep -i "replay\|sum of\|error" $OUT/kernels_${seqs}_pdl$pdl.txt
        done
    done
fi
if [[ $PARTS == *fresh* ]]; then
    # FRESH_VARIANTS: ";"-separated "NAME=TILE" (NAME: a w4_gemv module constant); default: down's tiles (run 130)
    IFS=';' read -ra VARIANTS <<< "${FRESH_VARIANTS:-INT_LONG_ROWS=4, 512, 4, False;INT_LONG_ROWS=8, 512, 4, True;\
INT_LONG_ROWS=8, 512, 4, False;INT_LONG_ROWS=4, 512, 4, True}"
    for round in 1 2; do
        for v in "${VARIANTS[@]}"; do
            echo "round $round, ${v%%=*} (${v#*=})"
            timeout 100 python3 scripts/step_ab.py "import orinfer.kernels.w4_gemv as m
m.${v%%=*} = m.W4GemvConfig(${v#*=})" 2>&1 | grep -i "replay\|error"
        done
    done
fi
if [[ $PARTS == *bench* ]]; then
    SKIP_TESTS=1 bash scripts/gpu_session4b.sh
fi
if [[ $PARTS == *graphs* ]]; then
    timeout 300 python3 scripts/graph_count_ab.py 2>&1 | grep -i "replay\|error"
fi
if [[ $PARTS == *order* ]]; then
    IFS=';' read -ra VARIANTS <<< "${ORDER_VARIANTS:-1;64;64 b1-first;1;64 b1-first;64}"
    for v in "${VARIANTS[@]}"; do
        timeout 150 python3 scripts/capture_order_ab.py $v 2>&1 | grep -i "replay\|error"
    done
fi
if [[ $PARTS == *seqs* ]]; then
    for v in 1,128b,2048,8192 64,128b,2048,8192 64,128b,2048,2048 64,128b,2048,4096; do
        timeout 120 python3 scripts/decode_graph_variants.py $v 2>&1 | grep -i "replay\|error"
    done
fi
