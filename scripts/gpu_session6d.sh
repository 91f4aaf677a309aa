#!/usr/bin/env bash
# Device call (session 6): straight-line W4 GEMV for rows of up to UNROLL_STEPS steps, PDL wait first. W4 GEMV
# kernel tests on the GPU, then the AWQ batch-1 decode step with down's 3 steps unrolled (default) and as a loop
# (UNROLL_STEPS = 1), then the bf16 step for reference.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
timeout 200 python3 -m pytest -q -m "gpu or not gpu" tests/test_w4.py -k "gemv or linear or gate_up" -x 2>&1 | tail -2
for steps in 4 1 4; do
    echo "AWQ UNROLL_STEPS=$steps"
    timeout 150 python3 -c "
import runpy, sys
import orinfer.kernels.w4_gemv as m
m.UNROLL_STEPS = $steps
sys.argv = ['decode_overhead.py', '--quant', 'awq']
runpy.run_path('scripts/decode_overhead.py', run_name='__main__')" 2>&1 | tail -3 | head -2
done
