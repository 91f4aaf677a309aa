#!/usr/bin/env python3
"""A/B (device): the tensor-core one-row W4 GEMV prototype (scripts/w4_tc_proto.py) against `w4_gemv`'s default on
Qwen3-8B's four projections (scripts/one_row_ab.py). Usage: python3 scripts/w4_tc_ab.py [OUT_JSON] (writes the best
config per kind for `w4_tc_proto.install`)"""
from __future__ import annotations

import sys

from one_row_ab import run_ab
from w4_tc_proto import w4_tc_gemv

# (block_n, warps, perm, early_sz, fence): session 10's operand layout, then session 11's 16-byte loads with all
# loads fenced before the MMAs
CONFIGS = [(16, 8, False, False, False), (16, 4, True, True, True), (16, 8, True, True, True),
           (32, 8, True, True, True), (32, 4, True, True, True), (16, 16, True, True, True), (32, 16, True, True, True),
           (16, 8, True, True, False), (64, 8, True, True, True)]


def candidates(name, x, w4, gated):
    out = []
    for bn, warps, perm, early, fence in CONFIGS:
        if (w4[0].in_features // 128) % warps:
            continue
        kw = dict(block_n=bn, warps=warps, perm=perm, early_sz=early, fence=fence)
        label = "tc " + ",".join(f"{a}={b}" for a, b in kw.items())
        out.append((label, lambda i, kw=kw: w4_tc_gemv(x, w4[i], gated, **kw), kw))
    return out


if __name__ == "__main__":
    run_ab(candidates, sys.argv[1] if len(sys.argv) > 1 else None)
