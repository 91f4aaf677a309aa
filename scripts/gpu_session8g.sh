#!/usr/bin/env bash
# Device calls (session 8, runs 86-89): is AWQ decode at batch 32 slower than before this session (6511 tok/s in run 85
# against 6779-6838 in runs 59-68)? The bench (batch 8/32; 1/8/32 from run 88 on) for each tree of TREES, alternated:
# this tree and old_tree/, made with `mkdir old_tree && git archive d70af72 | tar -x -C old_tree` (run 89 also had
# copies of this tree with the old attention.py, or with the old pdl/norm/rotary files). The trees are not kept.
set -uo pipefail
export PYTHONUNBUFFERED=1
for round in 1 2; do
    for tree in ${TREES:-. old_tree}; do
        echo "round $round $tree: $(cd $tree && PYTHONPATH=$PWD timeout 200 python3 -m orinfer bench \
            --synthetic qwen3-8b --quant awq --batch-sizes 1,8,32 --prompt-lens 128 2>&1 \
            | grep 'decode batch' | tr '\n' ' ')"
    done
done
