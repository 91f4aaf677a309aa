#!/usr/bin/env bash
# Device calls (session 12). PARTS picks what runs (default "int"):
#   int     the integer one-row W4 GEMV (kernels/w4_int_step.py): accuracy beside w4_gemv, its tiles per Qwen3-8B
#           shape (scripts/w4_gemv_int_ab.py), then the batch-1 AWQ step with it for every kind, gate_up only, qkv
#           and o only, down only (runs 114-115 ran the same kernel as scripts/w4_dp2a_proto.py, folded into the
#           engine since, patched into w4_ops)
#   l2      prefetching a GEMV's weights into L2 during a spin that stands for the short kernels before it
#           (scripts/l2_prefetch_ab.py, run 115)
#   engine  the engine with w4_gemv_int: its GPU tests, the step replay, and the decode step's kernel table (run 116)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}
PARTS=${PARTS:-int}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 100 python3 scripts/decode_overhead.py --quant awq 2>&1 | grep replay
step_routed() {  # $1: the kinds that take w4_gemv_int ("short", "gated", "long"), tiles from $OUT/best_int.json
    echo "w4_gemv_int for: $1"
    timeout 100 python3 scripts/step_ab.py "import json
from orinfer.kernels import w4_gemv as G, w4_int_step as I, w4_ops
best = json.load(open('$OUT/best_int.json'))
kind = lambda w, gated: 'gated' if gated else ('long' if w.in_features > 4096 else 'short')
I.takes = lambda x, w, gated: x.dtype != I.torch.float32 and kind(w, gated) in '$1'.split()
tiles = {k: G.W4GemvConfig(*c) for k, c in best.items()}
w4_ops.w4_gemv_int = lambda x, w, b=None, g=False: G.w4_gemv_int(x, w, b, g, tiles.get(kind(w, g)))" \
        2>&1 | grep -i "replay\|error"
}
if [[ $PARTS == *int* ]]; then
    timeout 300 python3 scripts/w4_gemv_int_ab.py $OUT/best_int.json 2>&1 | grep -v Warning
    for kinds in "short gated long" "gated long" "gated" "short" "long"; do step_routed "$kinds"; done
fi
if [[ $PARTS == *l2* ]]; then
    timeout 300 python3 scripts/l2_prefetch_ab.py 4 8 2>&1 | grep -v Warning
fi
if [[ $PARTS == *engine* ]]; then
    timeout 400 python3 -m pytest -q -m "gpu or not gpu" tests/test_w4.py -k "int or gpu" > $OUT/test_w4_int.txt 2>&1
    echo "test_w4 -k 'int or gpu' (exit $?): $(tail -n 1 $OUT/test_w4_int.txt)"
    timeout 300 python3 -m pytest -q -m gpu tests/test_awq.py tests/test_gpu_engine.py > $OUT/test_engine.txt 2>&1
    echo "test_awq + test_gpu_engine (exit $?): $(tail -n 1 $OUT/test_engine.txt)"
    timeout 100 python3 scripts/decode_overhead.py --quant awq 2>&1 | grep replay
    timeout 200 python3 scripts/profile_step.py --quant awq 2>&1 | grep -v Warning | tail -32
fi
