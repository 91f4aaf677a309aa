#!/usr/bin/env bash
# Device call (session 6): where an AWQ batch-1 decode step goes (per-kernel profile, graph replay vs engine step).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 250 python3 scripts/profile_step.py --quant awq 2>&1 | grep -v "^\s*$" | tail -60 | tee "$OUT/profile_awq.txt"
timeout 200 python3 scripts/decode_overhead.py --quant awq 2>&1 | tail -5 | tee "$OUT/overhead_awq.txt"
