#!/usr/bin/env bash
# Device call (session 9): the batch-1 decode graph under engine configurations (scripts/decode_graph_variants.py),
# then the new dequantisation's GPU tests and its tile sweep.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
timeout 300 python3 scripts/decode_graph_variants.py 2>&1 | grep -v Warning
timeout 150 python3 -m pytest -q -m gpu tests/test_w4.py tests/test_awq.py -k "dequant or prefill or linear" 2>&1 \
    | tail -n 2
timeout 200 python3 scripts/dequant_sweep.py
