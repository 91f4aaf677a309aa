#!/usr/bin/env bash
# Device call (session 7): vision-tower op alternatives (scripts/vision_ops_ab.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
timeout 120 python3 scripts/vision_ops_ab.py 2>&1 | grep -v Warning
