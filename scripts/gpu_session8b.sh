#!/usr/bin/env bash
# Device call (session 8): the batch-1 AWQ decode step (graph replay) under each patch of a variants file
# ("name|python source" per line, scripts/step_ab.py), two rounds.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
for round in 1 2; do
    while IFS='|' read -r name patch; do
        [ -z "$name" ] && continue
        echo "round $round $name: $(timeout 150 python3 scripts/step_ab.py "$patch" 2>&1 | grep replay | head -1)"
    done < "${1:?variants file}"
done
