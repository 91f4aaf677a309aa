"""Launch configs of the MoE kernels: defaults, and the per-GPU tables that `python -m orinfer.kernels.moe_tune` writes.

A `MoeConfig` says which path runs a call of `fused_moe` and how its two GEMMs are tiled:

    path     "decode" (`moe_decode`: per-expert GEMVs over the pairs as routed, few tokens) or "grouped"
             (`moe_align` + the grouped GEMMs of `moe_gemm` + the combine), or "gemv" (one token, FP8 experts or
             16-bit ones with x of their dtype: `moe_fp8_decode` / `moe_gemv16`, one-row GEMVs in 16-byte chunks;
             block_m 1), or "a8" (FP8 experts at prefill with 16-bit x: the W8A8 grouped GEMMs of `moe_a8`)
    block_m  grouped, a8: rows per expert block (16, 32, 64 or 128); decode: 1 = one token, FMA loop on the CUDA cores,
             16 = up to 16 tokens, tensor-core dots with the tokens padded to 16
    up       Tile of the gate/up + SwiGLU GEMM: (block_n, block_k, num_warps, num_stages)
    down     Tile of the down GEMM (gemv: block_k counts the inputs of all the pairs a step reads side by side)
    split    decode only: the pairs of a step are shared over this many programs per down tile (then a sum kernel)
    uniform_scale  a8 only: `moe_a8.A8Config.uniform_scale` (one FFMA an element promotes a K step's dot)

Table files (`moe_configs/<GPU>_E<E>_H<H>_I<I>_k<k>_<dtype>.json`, GPU = torch.cuda.get_device_name with every run of
characters other than letters, digits, '-', '.' made '_'; dtype = the weights', bfloat16, float16 or float8_e4m3fn
(FP8 block-wise experts, tuned with 128x128 blocks: their tiles already step inside one scale column), or w4g<G> for
4-bit experts in groups of G (AWQ, GPTQ-Int4: tiles already in W4 chunks, `moe_w4.w4_config` leaves them as they are),
or W8A8_LABEL for the "a8" configs of FP8 experts at prefill, a table of its own beside the float8_e4m3fn one: the
W8A8 kernels take the calls from `moe_a8.MIN_TOKENS` tokens, and only from that table):

    {"device": "NVIDIA H200", "experts": 128, "hidden": 2048, "inter": 768, "top_k": 8, "dtype": "bfloat16",
     "configs": {"1": {"path": "decode", "block_m": 1, "up": [4, 512, 4, 1], "down": [2, 1024, 4, 1], "split": 1,
                       "us": 61.2},
                 "64": {"path": "grouped", "block_m": 16, "up": [64, 64, 4, 3], "down": [64, 64, 4, 3], ...}, ...}}

Keys are token counts T; a call with T tokens takes the entry of the smallest key >= T (the largest key beyond the
table's range). Extra fields (the measured "us") are ignored. A table applies to 16-bit activations with weights of its
dtype; fp32 and mixed (fp32 x, 16-bit weights) calls, and shapes or GPUs without a table, take `default_config`.
FP8 experts with 16-bit x at T = 1 run the gemv path whatever the table says; a "gemv" entry gives its tiles
(`kernels/moe_ops.py`). 16-bit experts at T = 1 run it only where their table's entry is a "gemv" config.
Experts with a folded shared expert (layers/moe.py: E routed experts + 1 slot, k + 1 pairs a token) take the table of
their own shape (E + 1, k + 1) when there is one, else that of the routed experts (E, k): the same weights per pair
and one more pair a token (the shared slot's, chosen by every token), which tiles tuned for k pairs run well.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import NamedTuple

import torch

TABLE_DIR = Path(__file__).with_name("moe_configs")
DECODE_MAX_TOKENS = 16          # the decode path's dot pads the tokens to 16
GEMV = "gemv"                   # the path of the one-token GEMV kernels (`moe_fp8_decode`, `moe_gemv16`)
GROUPED_BLOCK_M = (16, 32, 64, 128)
A8 = "a8"                       # the path of the W8A8 FP8 expert kernels (`moe_a8`)
W8A8_LABEL = "float8_e4m3fn_w8a8"  # the weights' part of the name of their tables


class Tile(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class MoeConfig(NamedTuple):
    path: str
    block_m: int
    up: Tile
    down: Tile
    split: int = 1
    uniform_scale: bool = False


def valid(cfg: MoeConfig, tokens: int) -> bool:
    """Whether `cfg` can run a call of `tokens` tokens (a table entry may have been measured for more)."""
    if cfg.path == "decode":
        return (cfg.block_m == 1 and tokens == 1) or (cfg.block_m == 16 and tokens <= DECODE_MAX_TOKENS)
    if cfg.path == GEMV:
        return cfg.block_m == 1 and tokens == 1
    return cfg.path in ("grouped", A8) and cfg.block_m in GROUPED_BLOCK_M


def default_config(tokens: int, experts: int, top_k: int, wide: bool) -> MoeConfig:
    """The config without a table. wide: fp32 math (fp32 or mixed activations), whose exact dots want small tiles."""
    if tokens == 1:
        if wide:
            return MoeConfig("decode", 1, Tile(4, 128, 4, 1), Tile(4, 128, 4, 1))
        # FMA loops are not pipelined: latency is hidden by occupancy, so each program loads 4-8 KB per step and
        # there are about as many programs as fit on the GPU at once (8 experts of Qwen3-30B-A3B: 1536 and 1024).
        return MoeConfig("decode", 1, Tile(4, 512, 4, 1), Tile(2, 1024, 4, 1))
    if tokens <= 8:
        split = -(-tokens * top_k // 8)                           # about 8 pairs per program
        if wide:
            return MoeConfig("decode", 16, Tile(32, 32, 4, 2), Tile(32, 32, 4, 2), split)
        return MoeConfig("decode", 16, Tile(64, 128, 4, 3), Tile(64, 128, 4, 3), split)
    rows = tokens * top_k / experts                               # mean rows per expert
    block_m = 16 if rows <= 24 else 32 if rows <= 48 else 64
    if wide:
        return MoeConfig("grouped", min(block_m, 32), Tile(32, 32, 4, 2), Tile(32, 32, 4, 2))
    block_n = 64 if block_m <= 32 else 128
    return MoeConfig("grouped", block_m, Tile(block_n, 64, 4, 3), Tile(block_n, 64, 4, 3))


def table_name(device_name: str, experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype | str) -> str:
    """The table file's name; `dtype`: the weights' torch dtype, or a label (4-bit experts: `w4_label`)."""
    gpu = re.sub(r"[^A-Za-z0-9.-]+", "_", device_name).strip("_")
    weights = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return f"{gpu}_E{experts}_H{hidden}_I{inter}_k{top_k}_{weights}.json"


def w4_label(group_size: int) -> str:
    """The weights' part of a 4-bit expert table's name: AWQ and GPTQ-Int4 experts share the W4 layout, so a table
    serves both at one group size."""
    return f"w4g{group_size}"


def config_to_json(cfg: MoeConfig) -> dict:
    entry = {"path": cfg.path, "block_m": cfg.block_m, "up": list(cfg.up), "down": list(cfg.down), "split": cfg.split}
    if cfg.path == A8:
        entry["uniform_scale"] = cfg.uniform_scale
    return entry


def config_from_json(entry: dict) -> MoeConfig:
    return MoeConfig(str(entry["path"]), int(entry["block_m"]), Tile(*map(int, entry["up"])),
                     Tile(*map(int, entry["down"])), int(entry.get("split", 1)),
                     bool(entry.get("uniform_scale", False)))


@functools.lru_cache(maxsize=None)
def load_table(path: str) -> dict[int, MoeConfig]:
    """A table file's configs by token count ({} when the file does not exist)."""
    p = Path(path)
    if not p.is_file():
        return {}
    with open(p) as f:
        data = json.load(f)
    return {int(t): config_from_json(entry) for t, entry in data["configs"].items()}


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table_config(tokens: int, table: dict[int, MoeConfig]) -> MoeConfig | None:
    """The entry for `tokens`: the smallest key >= tokens, else the largest; None when the table has none that fits."""
    if not table:
        return None
    keys = sorted(table)
    key = next((k for k in keys if k >= tokens), keys[-1])
    cfg = table[key]
    return cfg if valid(cfg, tokens) else None


def table_lookup(x: torch.Tensor, experts: int, hidden: int, inter: int, top_k: int, weights: torch.dtype | str
                 ) -> MoeConfig | None:
    """The current GPU's table entry for x's T tokens and this expert shape and weights (None without one). Host-only
    (a cached file read): safe inside CUDA-graph capture."""
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return table_config(x.shape[0], table_for(_device_name(index), experts, hidden, inter, top_k, weights))


def table_for(device_name: str, experts: int, hidden: int, inter: int, top_k: int, weights: torch.dtype | str
              ) -> dict[int, MoeConfig]:
    """The table of this GPU, expert shape and weights, or for E slots and k pairs without one, that of E - 1 experts
    and k - 1 pairs (a folded shared expert's slot beside routed experts that have a table: module docstring); {}
    when neither exists."""
    table = load_table(str(TABLE_DIR / table_name(device_name, experts, hidden, inter, top_k, weights)))
    if not table and experts > 1 and top_k > 1:
        table = load_table(str(TABLE_DIR / table_name(device_name, experts - 1, hidden, inter, top_k - 1, weights)))
    return table


def pick_config(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> MoeConfig:
    """The config for fused_moe(x, w13, ...): the current GPU's table for this shape when there is one and x has the
    weights' 16-bit dtype, else `default_config`. Host-only (a cached file read): safe inside CUDA-graph capture."""
    tokens = x.shape[0]
    experts, two_inter, hidden = w13.shape
    wide = x.dtype == torch.float32 or w13.dtype == torch.float32
    if x.is_cuda and not wide:
        cfg = table_lookup(x, experts, hidden, two_inter // 2, top_k, w13.dtype)
        if cfg is not None:
            return cfg
    return default_config(tokens, experts, top_k, wide)
