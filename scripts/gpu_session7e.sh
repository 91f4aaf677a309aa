#!/usr/bin/env bash
# Device call (session 7): interleaved A/B of the vision tower's fc1 (cuBLASLt GELU epilogue vs GEMM + bias_gelu).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
timeout 200 python3 scripts/vision_ab.py --rounds 7 2>&1 | grep -v Warning
