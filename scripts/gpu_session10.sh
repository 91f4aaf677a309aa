#!/usr/bin/env bash
# Device calls (session 10). PARTS picks what runs (default "tc"):
#   tc     the tensor-core one-row W4 GEMV prototype (scripts/w4_tc_proto.py) against w4_gemv per shape, and in the
#          engine's batch-1 AWQ step (run 104; run 103 ran an earlier version, see benchmarks/NOTES.md)
#   tiles  GEMV tiles not tried in the engine step before (step_ab patches), then the official AWQ and bf16
#          benchmarks (scripts/gpu_session4b.sh) (run 106)
#   regs   the gated GEMV (gate_up) held to 96 or 80 registers, so that more of its 768 programs are resident at once
#          (run 107)
#   cache  the GEMV's weight loads as ld.global.cg (no L1 allocation, default L2 policy) instead of L1/L2 evict_first
#          (run 108)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
PARTS=${PARTS:-tc}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 100 python3 scripts/decode_overhead.py --quant awq 2>&1 | grep replay
if [[ $PARTS == *tc* ]]; then
    timeout 240 python3 scripts/w4_tc_ab.py 2>&1 | grep -v Warning
    for p in "(16, 8), (16, 8)" "(16, 16), (16, 16)"; do
        echo "tc $p"
        timeout 100 python3 scripts/step_ab.py "import w4_tc_proto as m; m.install($p)" 2>&1 | grep -i "replay\|error"
    done
fi
if [[ $PARTS == *tiles* ]]; then
    M="import orinfer.kernels.w4_gemv as m; C = m.W4GemvConfig"
    for p in "m.DEFAULT_GEMV = C(16, 256, 4)" "m.DEFAULT_GEMV = C(16, 512, 8)" \
             "m.UNROLL_STEPS = 6; m.DEFAULT_GEMV_LONG_ROWS = C(8, 256, 4)" \
             "m.DEFAULT_GEMV_LONG_ROWS = C(16, 256, 8)"; do
        echo "patch: $p"
        timeout 100 python3 scripts/step_ab.py "$M; $p" 2>&1 | grep -i "replay\|error"
    done
    SKIP_TESTS=1 bash scripts/gpu_session4b.sh
fi
if [[ $PARTS == *regs* ]]; then
    for n in 96 80; do
        echo "gated GEMV maxnreg $n"
        timeout 100 python3 scripts/step_ab.py "import orinfer.kernels.w4_gemv as m; k = m._w4_gemv_kernel; run = k.run
k.run = lambda *a, **kw: run(*a, **(kw | ({'maxnreg': $n} if kw.get('GATED') else {})))" 2>&1 | grep -i "replay\|error"
    done
fi
if [[ $PARTS == *cache* ]]; then
    echo "weights ld.global.cg"
    timeout 100 python3 scripts/step_ab.py "import orinfer.kernels.w4_gemv as m; f = m._load_step
f._unsafe_update_src(f.src.replace('eviction_policy=\"evict_first\"', 'cache_modifier=\".cg\"'))
m._w4_gemv_kernel.hash = None" 2>&1 | grep -i "replay\|error"
fi
