#!/usr/bin/env python3
"""A/B (device): the pipelined one-row W4 GEMV prototype (scripts/w4_pipe_proto.py) against `w4_gemv`'s default on
Qwen3-8B's four projections (scripts/one_row_ab.py). Usage: python3 scripts/w4_pipe_ab.py [OUT_JSON] (writes the
best config per kind for `w4_pipe_proto.install`)"""
from __future__ import annotations

import sys

from one_row_ab import run_ab
from w4_pipe_proto import pack_scale_zero, w4_pipe_gemv

# (block_n, warps, stages, per_sm, x_smem) per shape
SHORT = [(16, 4, 4, 3, True), (32, 4, 3, 2, True), (16, 2, 4, 4, True), (32, 8, 3, 2, True), (16, 4, 4, 3, False),
         (8, 2, 4, 6, True), (32, 4, 4, 2, True)]
GATED = [(16, 4, 3, 2, True), (16, 4, 2, 3, True), (8, 2, 4, 4, True), (16, 4, 3, 3, False), (32, 8, 2, 2, True),
         (8, 4, 4, 4, True), (16, 8, 3, 2, True)]
LONG = [(16, 4, 4, 3, False), (8, 2, 4, 6, False), (32, 4, 3, 2, False), (16, 4, 6, 3, False), (16, 2, 4, 5, False),
        (8, 4, 4, 5, False)]
CONFIGS = {"qkv": SHORT, "o": SHORT, "gate_up": GATED, "down": LONG}


def candidates(name, x, w4, gated):
    sz = [pack_scale_zero(w) for w in w4]
    out = []
    for c in CONFIGS[name]:
        label = f"pipe ({c[0]}, {c[1]}, {c[2]}, {c[3]}, {'xsmem' if c[4] else 'xglobal'})"
        out.append((label, lambda i, c=c: w4_pipe_gemv(x, w4[i], sz[i], gated, block_n=c[0], warps=c[1], stages=c[2],
                                                        per_sm=c[3], x_smem=c[4]), list(c)))
    return out


if __name__ == "__main__":
    run_ab(candidates, sys.argv[1] if len(sys.argv) > 1 else None)
