#!/usr/bin/env bash
# Device call (session 6): the one-row GEMV's default tile measured where it matters, in the engine's batch-1 AWQ
# decode step (graph replay), for a few (BLOCK_N, BLOCK_KP, WARPS) tiles set in place of DEFAULT_GEMV.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
for cfg in "16, 512, 4" "32, 512, 4" "32, 512, 8" "16, 512, 4"; do
    echo "DEFAULT_GEMV = ($cfg)"
    timeout 150 python3 -c "
import runpy, sys
import orinfer.kernels.w4_gemv as m
m.DEFAULT_GEMV = m.W4GemvConfig($cfg)
sys.argv = ['decode_overhead.py', '--quant', 'awq']
runpy.run_path('scripts/decode_overhead.py', run_name='__main__')" 2>&1 | tail -2 | head -1
done
