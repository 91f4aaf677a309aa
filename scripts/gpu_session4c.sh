#!/usr/bin/env bash
# Device call (session 4, last): a 32-row sweep of the W4 MMA tiles, then scripts/gpu_session4b.sh (GPU tests, AWQ
# and bf16 benchmarks in one call, the AWQ memory figure).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W4_SWEEP_GEMV=default timeout 200 python3 scripts/w4_sweep.py 32 2>/dev/null | grep "^| .* 32 |" | head -30
bash scripts/gpu_session4b.sh
