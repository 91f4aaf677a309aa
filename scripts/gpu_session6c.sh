#!/usr/bin/env bash
# Device call (session 6, runs 60-61): does PDL help inside the engine's decode graphs? Batch-1 decode step (graph
# replay vs engine step) for AWQ and bf16 with PDL on and off (ORINFER_PDL=0). Runs 61-63 also used temporary
# switches in kernels/w4_gemv.py (PDL off for the W4 GEMV alone, weights loaded before the PDL wait or after, the
# one-step row as a loop), removed once measured: benchmarks/NOTES.md.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
for q in "--quant awq" ""; do
    for pdl in 1 0; do
        echo "${q:-bf16} ORINFER_PDL=$pdl"
        ORINFER_PDL=$pdl timeout 150 python3 scripts/decode_overhead.py $q 2>&1 | tail -3 | head -2
    done
done
