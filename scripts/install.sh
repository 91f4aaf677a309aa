#!/usr/bin/env bash
# Installs orinfer into a virtual environment ($VENV, default .venv). Usage: scripts/install.sh [test]
#
# torch is installed first and on purpose: with no NVIDIA GPU, a plain `pip install torch` pulls several GB of CUDA
# wheels. On a CPU-only machine we take a CPU build: a local wheel if pip is configured with one (find-links), else
# PyTorch's CPU index. With a GPU, PyPI's default (CUDA) build. An existing torch in the venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
extra=${1:-}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "installing torch (CUDA build)"
    "${pip[@]}" torch
  else
    echo "no NVIDIA GPU found: installing a CPU build of torch"
    # A local CPU wheel (pip's find-links) first, without deps, which are then fetched from the normal index.
    if "${pip[@]}" --no-index --no-deps torch 2>/dev/null; then
      "${pip[@]}" torch
    else
      "${pip[@]}" torch --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
    fi
  fi
fi

if [ "$extra" = "test" ]; then
  "${pip[@]}" -c scripts/test-constraints.txt -e ".[test]"
else
  "${pip[@]}" -e .
fi
echo "orinfer installed in $VENV"
