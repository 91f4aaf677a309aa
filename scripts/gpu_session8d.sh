#!/usr/bin/env bash
# Device call (session 8): small kernels signal PDL before their wait (all of them); GPU tests of those kernels, the
# step variants of scripts/step_variants_8d.txt, decode attention against context length and split count, and the
# GEMV timeline (scripts/step_timeline.py).
# ORINFER_PDL_EARLY (noearly variant) was a temporary switch of this session; signalling first is now the default and
# the variable is gone.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
timeout 200 python3 -m pytest -q -m "gpu or not gpu" tests/test_kernels.py \
    -k "rms or rope or store or combine or decode or paged" 2>&1 | tail -n 1
bash scripts/gpu_session8b.sh scripts/step_variants_8d.txt
timeout 120 python3 scripts/decode_attention_splits.py 2>&1 | grep -v Warn
timeout 120 python3 scripts/step_timeline.py 2>&1 | grep -v Warn | tail -5
