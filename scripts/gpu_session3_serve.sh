#!/usr/bin/env bash
# Device call (session 3): W4 MMA sweep at 8/16 rows, the bf16 lookahead A/B, and the serving benchmark (Qwen3-8B
# shapes, random weights) with the split server, merged stream updates and lookahead decode.
# Needs the server's wheels carried in build/wheels (pip download fastapi uvicorn httpx for the device's python).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
AWQ_SWEEP_SHAPES=qkv,gate_up,down python3 scripts/w4_sweep.py 8 16 > "$OUT/w4_sweep_mma.md" 2> "$OUT/w4_sweep_mma.err"
grep "w4_mma\|awq-layout" "$OUT/w4_sweep_mma.md" | head -40
python3 -m orinfer bench --synthetic qwen3-8b --no-async-scheduling --batch-sizes 1 --prompt-lens 512 \
    --out "$OUT/bf16_sync" > "$OUT/bench_bf16_sync.txt" 2>&1; grep "decode" "$OUT/bench_bf16_sync.txt"
python3 -m pip install -q --no-index --find-links build/wheels --target /tmp/pydeps fastapi uvicorn httpx > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/pydeps
timeout 300 python3 scripts/bench_serve_synthetic.py --synthetic qwen3-8b --concurrency 1 8 64 --max-tokens 128 \
    --out "$OUT/serve-qwen3-8b-bfloat16.json" > "$OUT/serve.txt" 2>&1; grep -v "^INFO" "$OUT/serve.txt" | tail -12
