#!/usr/bin/env python3
"""A/B (device): the integer one-row W4 GEMV with x's words made beforehand (scripts/w4_words_proto.py) against
`w4_gemv`'s default and `w4_gemv_int`, per Qwen3-8B projection (scripts/one_row_ab.py): what producers that write
the words would save. Usage: python3 scripts/w4_words_ab.py"""
from __future__ import annotations

from one_row_ab import run_ab
from orinfer.kernels.w4_gemv import W4GemvConfig, w4_gemv_int
from w4_words_proto import prepare_words, w4_words_gemv

TILES = {"qkv": [(16, 512, 4), (8, 512, 4), (16, 512, 8), (32, 512, 8)],
         "o": [(16, 512, 4), (8, 512, 4), (16, 512, 8), (4, 512, 4)],
         "gate_up": [(8, 512, 4), (16, 512, 4), (16, 512, 8), (4, 512, 4)],
         "down": [(4, 512, 4), (8, 512, 4), (16, 512, 4), (16, 512, 8)]}


def candidates(name, x, w4, gated):
    words = prepare_words(x)
    out = [(f"w4_gemv_int {t}", lambda i, t=t: w4_gemv_int(x, w4[i], gated=gated, cfg=W4GemvConfig(*t)), t)
           for t in TILES[name][:1]]
    return out + [(f"words {t}", lambda i, t=t: w4_words_gemv(words, w4[i], gated, W4GemvConfig(*t)), t)
                  for t in TILES[name]]


if __name__ == "__main__":
    run_ab(candidates)
