#!/usr/bin/env bash
# Device call (session 9, first): where batch-1 decode loses time inside the bench (scripts/decode_in_bench.py), the
# lm_head GEMV against the read ceiling, and the prefill dequantisation A/B (scripts/dequant_sweep.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
timeout 200 python3 scripts/decode_in_bench.py --quant awq 2>&1 | grep -v Warning
timeout 60 python3 scripts/lm_head_time.py
timeout 240 python3 scripts/dequant_sweep.py  # run 91 ran an A/B script, since made the kernel
