#!/usr/bin/env bash
# Device call (session 8): GPU tests of the W4 GEMV and decode attention (active-split combine, reverted after run 89),
# the step variants of scripts/step_variants_8c.txt, decode_overhead's full report, and the batch-1 AWQ bench alone.
# ORINFER_PDL_EARLY (small kernels signalling before their wait) was a temporary switch of this session; signalling
# first is now the default and the variable is gone.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -m "gpu or not gpu" tests/test_w4.py -k "gemv or linear or gate_up" -x 2>&1 | tail -n 1
for early in 0 1; do
    ORINFER_PDL_EARLY=$early timeout 150 python3 -m pytest -q -m "gpu or not gpu" tests/test_kernels.py \
        -k "rms or combine or decode or paged" 2>&1 | tail -n 1
done
bash scripts/gpu_session8b.sh scripts/step_variants_8c.txt
timeout 150 python3 scripts/decode_overhead.py --quant awq 2>&1 | tail -3
timeout 300 python3 -m orinfer bench --synthetic qwen3-8b --quant awq --batch-sizes 1 --prompt-lens 128 \
    --out "$OUT/awq_b1.json" 2>&1 | grep -i "decode\|batch" | tail -5
