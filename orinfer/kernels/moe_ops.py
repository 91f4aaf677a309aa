"""The MoE entry points of the triton backend: `moe_route` (kernels/moe_route.py) and `fused_moe`, which checks its
inputs and runs the path its config names (kernels/moe_config.py: the current GPU's tuned table, else defaults):

  decode  (a few tokens)   `moe_decode`: per-expert GEMVs over the pairs as routed, two launches (three with a split)
  grouped (larger batches) `moe_align` + `moe_gemm`: expert-sorted blocks, grouped gate/up and down GEMMs, the sum
  gemv    (one token, bf16 / fp16 experts with x of their dtype) `moe_gemv16`: one-row GEMVs in 16-byte chunks, two
          launches; only where the config names it (a table entry, or a forced config): without a "gemv" entry T = 1
          keeps the decode path

Both have `fused_moe_ref`'s contract and are CUDA-graph capturable: no host sync, and every buffer, grid and loop
bound comes from the shapes (T, k, E, H, I) and the config (picked from T on the host), never from the routing, so a
graph captured on one routing replays any other of the same T (the grouped path sizes its sorted rows for the worst
case and skips unused blocks on the device). Ids outside 0..E-1 select no expert instead of indexing out of bounds,
and the router never emits them, even for rows of NaN (a mixed-step graph's padding rows; kernels/moe_route.py).
Dtypes: x fp32/fp16/bf16 with weights of the same dtype, or fp32 x with 16-bit weights (mixed); other pairs take
`fused_moe_ref`, which syncs with the host (not capturable: refused inside a capture).

`fused_moe_fp8` runs the same two paths over FP8 block-wise experts (`kernels/moe_fp8.py`: e4m3 weights, fp32 block
scales applied in the kernels, any float x); a block width bk that is not a multiple of 16 takes its reference.
Prefill batches (`moe_a8.takes`: 16-bit x, `moe_a8.MIN_TOKENS` tokens or more) take the W8A8 grouped GEMMs of
`kernels/moe_a8.py` instead (x and h quantized per token and group, FP8 tensor cores) with the tiles of the GPU's W8A8
table (`moe_a8.tuned_config`) or the defaults, unless a config is forced (an "a8" config forces those kernels). One
token with 16-bit x takes a third path, "gemv" (`kernels/moe_fp8_decode.py`: the experts as one-row FP8 GEMVs in
16-byte chunks), whatever the table's entry for T = 1 names, unless that entry is a "gemv" config (its tiles run) or
the caller forces a config.
`fused_moe_w4` runs them over 4-bit experts (`kernels/moe_w4.py`: AWQ / GPTQ-Int4 repacked into W4; the kernels of
`kernels/moe_w4_gemm.py` unpack the words in registers), with the default configs (the tables are for 16-bit weights).
"""

from __future__ import annotations

import torch

from orinfer.kernels import moe_a8
from orinfer.kernels.gemv import check_device
from orinfer.kernels.moe import fused_moe_ref
from orinfer.kernels.moe_a8 import fused_moe_fp8_a8
from orinfer.kernels.moe_config import A8, GEMV, MoeConfig, default_config, pick_config, table_lookup, valid, w4_label
from orinfer.kernels.moe_decode import fused_moe_decode
from orinfer.kernels.moe_fp8 import check_expert_scales, fp8_config, fused_moe_fp8_ref
from orinfer.kernels.moe_fp8_decode import default_gemv_config, fused_moe_fp8_gemv
from orinfer.kernels.moe_gemm import fused_moe_grouped
from orinfer.kernels.moe_gemv16 import fused_moe_gemv16, gemv16_supported
from orinfer.kernels.moe_route import moe_route
from orinfer.kernels.moe_w4 import W4Experts, check_w4_experts, fused_moe_w4_ref, w4_config
from orinfer.kernels.moe_w4_gemm import fused_moe_w4_decode, fused_moe_w4_grouped

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["fused_moe", "fused_moe_fp8", "fused_moe_w4", "moe_route"]


def _supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.dtype in _FLOAT_TYPES and w.dtype in _FLOAT_TYPES and (x.dtype == w.dtype or x.dtype == torch.float32)


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    check_device(x)
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe takes x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    tokens, hidden = x.shape
    experts, two_inter, _ = w13.shape
    if w13.shape[2] != hidden or two_inter % 2 or tuple(w2.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not match x {tuple(x.shape)}")
    _check_routing(x, topk_weights, topk_ids)
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("expert weights must have unit stride along their last dim")
    if w13.dtype != w2.dtype:
        raise ValueError(f"w13 and w2 must have one dtype, got {w13.dtype} and {w2.dtype}")


def _check_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    tokens = x.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must be "
                         f"[T, k] with T = {tokens}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_ids must be int32/int64 and topk_weights a float tensor, got {topk_ids.dtype}, "
                         f"{topk_weights.dtype}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] (fp32; other float dtypes are widened),
    topk_ids [T, k] int32/int64 -> [T, H] in x's dtype, as `fused_moe_ref`. `config` forces a path and tiles (tests,
    the tuner); it must suit T (`valid`). A token's k ids must be distinct (top-k's are) on the decode path."""
    _check(x, w13, w2, topk_weights, topk_ids)
    if not _supported(x, w13):
        _refuse_capture(x, f"{w13.dtype} weights")
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    return _run(x, w13, w2, topk_weights, topk_ids, config)


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  block_size: tuple[int, int], topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  config: MoeConfig | None = None) -> torch.Tensor:
    """`fused_moe_fp8_ref`'s contract: w13 e4m3 [E, 2I, H] with s13 fp32 [E, 2 ceil(I/bn), ceil(H/bk)], w2 e4m3
    [E, H, I] with s2 fp32 [E, ceil(H/bn), ceil(I/bk)]; the rest as `fused_moe`. `config` is a 16-bit config (its
    K tiles are fitted to bk: `moe_fp8.fp8_config`), for one token a "gemv" config (`moe_fp8_decode`), or an "a8"
    config (the W8A8 kernels, `moe_a8`; 16-bit x); without one, the module docstring's dispatch."""
    _check(x, w13, w2, topk_weights, topk_ids)
    check_expert_scales(w13, s13, w2, s2, block_size)
    if x.dtype not in _FLOAT_TYPES or block_size[1] % 16:
        _refuse_capture(x, f"FP8 weights in blocks of {block_size[1]} inputs")
        return fused_moe_fp8_ref(x, w13, s13, w2, s2, block_size, topk_weights, topk_ids)
    a8 = None
    if config is not None and config.path == A8:              # forced (tests, the tuner)
        if not moe_a8.supported(x, block_size):
            raise ValueError(f"config {config} runs the W8A8 kernels, which take 16-bit x with experts in blocks whose "
                             f"width is a power of two >= 32; got {x.dtype} x, blocks {block_size}")
        a8 = moe_a8.from_config(config)
    elif config is None and moe_a8.takes(x, x.shape[0], block_size):
        a8 = moe_a8.tuned_config(x, w13, topk_ids.shape[1]) or moe_a8.default_config(x.shape[0])
    if a8 is not None:
        return fused_moe_fp8_a8(x.contiguous(), w13, s13, w2, s2, tuple(block_size), topk_weights.float().contiguous(),
                                topk_ids.contiguous(), a8)
    return _run(x, w13, w2, topk_weights, topk_ids, config, (s13, s2), tuple(block_size))


def fused_moe_w4(x: torch.Tensor, w13: W4Experts, w2: W4Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 config: MoeConfig | None = None) -> torch.Tensor:
    """`fused_moe_w4_ref`'s contract: w13 W4 experts of [E, 2I, H], w2 of [E, H, I]; the rest as `fused_moe`.
    `config` is a 16-bit config (tests); its K tiles become the W4 chunk (`moe_w4.w4_config`)."""
    check_device(x)
    check_w4_experts(x, w13, w2)
    _check_routing(x, topk_weights, topk_ids)
    if x.dtype not in _FLOAT_TYPES:
        _refuse_capture(x, "4-bit weights")
        return fused_moe_w4_ref(x, w13, w2, topk_weights, topk_ids)
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.empty(0, x.shape[1], dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    topk_weights, topk_ids = topk_weights.float().contiguous(), topk_ids.contiguous()
    cfg = config or _w4_table_config(x, w13, w2, top_k) or default_config(tokens, w13.num_experts, top_k,
                                                                          x.dtype == torch.float32)
    if not valid(cfg, tokens) or cfg.path in (GEMV, A8):
        raise ValueError(f"config {cfg} cannot run {tokens} tokens of 4-bit experts")
    cfg = w4_config(cfg, w13.group_size, w2.group_size)
    if cfg.path == "decode":
        return fused_moe_w4_decode(x, w13, w2, topk_weights, topk_ids, cfg)
    return fused_moe_w4_grouped(x, w13, w2, topk_weights, topk_ids, cfg)


def _w4_table_config(x: torch.Tensor, w13: W4Experts, w2: W4Experts, top_k: int) -> MoeConfig | None:
    """The tuned table's entry for 16-bit x on this GPU (one group size for both matrices), else None."""
    if not x.is_cuda or x.dtype == torch.float32 or w13.group_size != w2.group_size:
        return None
    return table_lookup(x, w13.num_experts, w13.in_features, w2.in_features, top_k, w4_label(w13.group_size))


def _refuse_capture(x: torch.Tensor, what: str) -> None:
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"fused_moe: {x.dtype} activations with {what} take the reference, which syncs with the host "
                         "and cannot be captured in a CUDA graph")


def _run(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
         config: MoeConfig | None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
         block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """The kernels of the config's path (inputs checked); `scales`, `block_size`: FP8 experts."""
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.empty(0, x.shape[1], dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    topk_weights, topk_ids = topk_weights.float().contiguous(), topk_ids.contiguous()
    cfg = pick_config(x, w13, top_k) if config is None else config
    if scales is not None and config is None and tokens == 1 and x.dtype != torch.float32 and cfg.path != GEMV:
        cfg = default_gemv_config(top_k, w2.shape[2])              # the table's T = 1 entry is for another path
    if not valid(cfg, tokens) or cfg.path == A8:  # "a8" configs: `fused_moe_fp8` takes them before this
        raise ValueError(f"config {cfg} cannot run {tokens} tokens of these experts")
    if cfg.path == GEMV and scales is None:
        if not gemv16_supported(x, w13):
            raise ValueError(f"config {cfg} cannot run {x.dtype} x with {w13.dtype} experts: the gemv path of 16-bit "
                             "experts takes bf16 / fp16 weights with x of their dtype")
        return fused_moe_gemv16(x, w13, w2, topk_weights, topk_ids, cfg)
    if cfg.path == GEMV:
        return fused_moe_fp8_gemv(x, w13, scales[0], w2, scales[1], block_size, topk_weights, topk_ids, cfg)
    if scales is not None:
        cfg = fp8_config(cfg, block_size[1])
    if cfg.path == "decode":
        return fused_moe_decode(x, w13, w2, topk_weights, topk_ids, cfg, scales, block_size)
    return fused_moe_grouped(x, w13, w2, topk_weights, topk_ids, cfg, scales, block_size)
