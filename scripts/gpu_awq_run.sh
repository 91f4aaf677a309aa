#!/usr/bin/env bash
# One device call for the AWQ work: kernel tests on the GPU, the decode-config sweep, then the AWQ benchmark.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -x tests/test_awq.py -k "gpu_every_candidate or gpu_awq_fused" 2>&1 | tail -15 | tee "$OUT/awq_tests.txt"
timeout 480 python3 scripts/awq_sweep.py "$@" 2>"$OUT/awq_sweep.err" | tee "$OUT/awq_sweep.md"
