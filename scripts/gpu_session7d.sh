#!/usr/bin/env bash
# Device call (session 7): the vision tower with fc1's bias + GELU in the cuBLASLt epilogue and token-major q/k/v
# (no transposing copy around cuDNN's attention). GPU tests of the vision kernels, the VL model and engine, and
# the tower graphs; the tower's profile and graph replay, also with fc1 as GEMM + bias_gelu (the previous path);
# then the VL benchmark against HF's tower in the same call. Writes 2 files under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 300 python3 -m pytest -q -m "gpu or not gpu" tests/test_vision_kernels.py 2>&1 | tail -n 1
timeout 300 python3 -m pytest -q -m gpu tests/test_vision_graphs.py tests/test_vl_model.py tests/test_vl_engine.py \
    2>&1 | tail -n 1
timeout 150 python3 scripts/profile_vision.py > "$OUT/profile_vision.txt" 2>&1
grep -E "graph replay|_kernel|nvjet|cudnn|elementwise" "$OUT/profile_vision.txt" | cut -c1-60,150-230 | head -16
echo "fc1 as GEMM + bias_gelu:"
timeout 150 python3 -c "
import runpy, sys
import orinfer.layers.triton_ops as t
t.linear_bias_gelu = lambda x, w, b, a='tanh': t.bias_gelu(t.triton_linear(x, w), b, a)
sys.argv = ['profile_vision.py']
runpy.run_path('scripts/profile_vision.py', run_name='__main__')" 2>&1 | grep "graph replay"
timeout 300 python3 -m orinfer bench --synthetic qwen3-vl-8b --image-size 1024x768 --batch-sizes 1 \
    --prompt-lens 2048 --out "$OUT/vl" 2>&1 | grep -v Warning | tail -n 12
