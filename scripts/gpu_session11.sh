#!/usr/bin/env bash
# Device calls (session 11). PARTS picks what runs (default "tc"):
#   pipe  the pipelined one-row W4 GEMV prototype (scripts/w4_pipe_proto.py) against w4_gemv per Qwen3-8B shape
#         (scripts/w4_pipe_ab.py), then in the engine's batch-1 AWQ step with the best config per kind (run 110)
#   tc    the tensor-core prototype (scripts/w4_tc_proto.py) with 16-byte weight loads and every load fenced before
#         the MMAs, per shape (scripts/w4_tc_ab.py), then in the step with the best config per kind
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-/tmp/out}
PARTS=${PARTS:-tc}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 100 python3 scripts/decode_overhead.py --quant awq 2>&1 | grep replay
step_with() {  # $1: module, $2: json file, $3: kinds
    echo "$1 for: $3"
    timeout 100 python3 scripts/step_ab.py "import json, $1 as m
c = json.load(open('$2')); m.install({k: c[k] for k in '$3'.split() if k in c})" 2>&1 | grep -i "replay\|error"
}
if [[ $PARTS == *pipe* ]]; then
    timeout 300 python3 scripts/w4_pipe_ab.py $OUT/best_pipe.json 2>&1 | grep -v Warning
    for kinds in "short gated long" "gated" "gated long"; do step_with w4_pipe_proto $OUT/best_pipe.json "$kinds"; done
fi
if [[ $PARTS == *tc* ]]; then
    timeout 300 python3 scripts/w4_tc_ab.py $OUT/best_tc.json 2>&1 | grep -v Warning
    if [[ -s $OUT/best_tc.json ]]; then
        for kinds in "short gated long" "gated" "short" "long"; do
            step_with w4_tc_proto $OUT/best_tc.json "$kinds"
        done
    fi
fi
