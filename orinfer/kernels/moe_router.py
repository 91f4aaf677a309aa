"""The MoE router of a decode-sized batch in one launch: router logits, softmax, top-k and renormalisation, and the
shared expert's gate logit (`moe.moe_router_ref`'s contract).

Math, for x [T, H] (1 <= T <= MAX_TOKENS) and the router weight W [N, H] with N = E, or E + 1 when its last row is
the shared expert's gate (layers/moe.py: SHARED_GATE_PACKING):

    logits[t, n] = round_x(sum_h x[t, h] W[n, h])   fp32 products and sums, rounded to x's dtype as the linear rounds
                                                    its output (mixed mode: fp32 x, 16-bit W widened as loaded)
    weights, ids = route(logits[:, :E])             kernels/moe_route.py's math, tie and NaN rules (its `route_rows`)
    shared_logit[t] = logits[t, E]                  (N = E + 1 only)

Outputs: weights [T, k] fp32, ids [T, k] int32, shared_logit [T, 1] in x's dtype (None when N = E). Folded (the
shared expert is the experts' slot E, `fold_shared`): weights and ids [T, k + 1], the last pair (sigmoid(round_x(
logits[t, E])), E) after the renormalisation (kernels/moe_route.py: `append_shared`), and no shared_logit: the
decode step's shared expert then runs inside the expert kernels, no launch of its own.

Why: at batch 1 the router is a ~1 MB GEMV and a 256-wide top-k, two kernels of ~5 us each on an H200 (cuBLAS, then
`moe_route`), nearly all launch and tail latency; here they are one launch whose routing runs in the GEMV's tail.

Kernel: grid (cdiv(N, BLOCK_N), SPLIT). Program (i, s) computes the partial logits of rows i * BLOCK_N .. + BLOCK_N
over its slice s of H for all T tokens: the one-row FMA loop of kernels/gemv.py at T = 1 (a [BLOCK_N, BLOCK_K] fp32
accumulator, reduced once), a tensor-core dot of the weight tile with x^T padded to 16 columns at T >= 2 (gemv's DOT
loop; an exact fp32 dot for fp32 or mixed x). It stores them in a workspace [SPLIT, T, N] fp32 and counts itself in
on a counter of splitk's persistent zeroed buffer (a CTA barrier, then one thread's acq_rel atomic at GPU scope, as
kernels/splitk.py: the release publishes the CTA's stores, the acquire of the last program sees everyone's). The
program that finds every other one counted (the last to finish, whichever it is) reads the workspace through L2
(`.cg`), sums the SPLIT partials in split order (deterministic), rounds, routes ROWS tokens at a time, writes the
gate logits, and sets the counter back to 0, so that the next launch (a CUDA-graph replay too) finds it at 0.
Launches sharing the counter must be ordered (one stream, as the engine runs; with PDL every kernel waits for its
predecessor's grid before touching memory, kernels/pdl.py). Buffers and grid come from the shapes alone: no host
sync, CUDA-graph capturable.

Bytes: the N * H weight elements dominate (Qwen3.5-35B-A3B: 257 x 2048 bf16 = 1.05 MB; Qwen3-30B-A3B: 128 x 2048 =
0.5 MB, ~0.1-0.25 us of HBM time at 4.8 TB/s: the kernel is latency-bound); x's T * H elements are read by every
program (from L2); the workspace is 4 * SPLIT * T * N bytes written and read once (L2); out T * k * 8 + T * 2 bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels import gemv
from orinfer.kernels.fp8_mm import sm_count
from orinfer.kernels.gemv import check_device, interpreting
from orinfer.kernels.gemv_rows import weight_tile
from orinfer.kernels.moe_route import MAX_EXPERTS, MAX_TOP_K, append_shared, route_rows
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.splitk import MAX_TILES, counters, plan

MAX_TOKENS = 16  # the DOT loop pads x to 16 columns; more tokens take the GEMM + moe_route
# The counter this kernel uses in splitk's buffer: the last one, which no split GEMM reaches (lm_head's 1187 tiles at
# most), so that a launch ordered wrongly by mistake could not meet a split GEMM's tile there either.
ROUTER_COUNTER = MAX_TILES - 1
# Logits the last program routes at once (ROWS tokens x BLOCK_E), ~16 fp32 values a thread at 4 warps: with 4096 (as
# `moe_route`'s programs) the 16-token bf16 kernel at E = 256 took 245 registers on sm_90, with 2048 140 (ptxas, no
# spills either way; tests/test_moe_router_codegen.py).
ROUTE_VALUES = 2048


class RouterConfig(NamedTuple):
    use_dot: bool
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split: int = 0  # slices of H; 0: splitk.plan's choice (programs enough for the chip)


# One token: 2 rows x 1024 inputs on one warp, H in 2 slices: 258 programs of 4 KB at N = 257, H = 2048. Timed on an
# H100 (graph replays over cold weights, NOTES run 349) against gemv's batch-1 tile (2 x 2048 on 2 warps, one slice)
# and 11 others: 5.55 us against 5.88 at 257 rows folded, 4.71 against 5.27 at 128 rows, the fastest of the 13 at
# both. The GEMV alone takes ~1.9 us; the rest is the last program's routing, whose k picks are reductions across
# the program's threads: on one warp they are register shuffles only, no shared memory or barrier.
ONE_ROW = RouterConfig(False, 2, 1024, 1, 1, 2)
# 2..16 tokens: wgmma tiles of 64 weight rows (gemv's DEFAULT_DOT), H split until the grid has ~2 programs an SM or
# the slices are 2 steps: 5 x 8 = 40 programs of 32 KB at N = 257.
FEW_ROWS = RouterConfig(True, 64, 128, 4, 3)
# fp32 or mixed x with several tokens: the exact fp32 dot (gemv's DEFAULT_DOT_F32 tile).
FEW_ROWS_F32 = RouterConfig(True, 32, 32, 4, 4)
MIN_STEPS = 2  # K steps a split keeps at least (splitk.plan)


@triton.jit
def _summed(ws_ptr, offs, mask, plane, SPLIT: tl.constexpr):
    """The SPLIT partials at `offs` (any shape) summed in split order (plane: elements a split), read from L2 (.cg):
    an L1 line of an earlier launch could be stale."""
    total = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, SPLIT):
        total += tl.load(ws_ptr + s * plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _route_tokens(ws_ptr, wts_ptr, ids_ptr, gate_ptr, T, N, E, act_ty: tl.constexpr, TOP_K: tl.constexpr,
                  RENORM: tl.constexpr, HAS_GATE: tl.constexpr, FOLD: tl.constexpr, SPLIT: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr):
    """The last program's work: every token's logits from the workspace, rounded to x's dtype, routed and stored;
    the gate logit (column E) stored in x's dtype, or (FOLD) appended as the shared expert's pair."""
    offs_e = tl.arange(0, BLOCK_E)
    pad = offs_e[None, :] >= E
    offs_k = tl.arange(0, BLOCK_KS)
    for t0 in range(0, T, ROWS):
        rows = t0 + tl.arange(0, ROWS)
        src = tl.minimum(rows, T - 1).to(tl.int64)      # rows past T re-read row T - 1 and are not stored
        logits = _summed(ws_ptr, src[:, None] * N + offs_e[None, :], ~pad, T * N, SPLIT)
        logits = tl.where(pad, float("-inf"), logits.to(act_ty).to(tl.float32))
        weights, ids = route_rows(logits, pad, TOP_K, RENORM, BLOCK_E, BLOCK_KS)
        if HAS_GATE:
            gate = _summed(ws_ptr, src * N + E, rows < T, T * N, SPLIT).to(act_ty)
            if FOLD:
                weights, ids = append_shared(weights, ids, gate.to(tl.float32), E, TOP_K, BLOCK_KS)
            else:
                tl.store(gate_ptr + rows, gate, mask=rows < T)
        out = rows.to(tl.int64)[:, None] * (TOP_K + FOLD) + offs_k[None, :]
        mask = (rows[:, None] < T) & (offs_k[None, :] < TOP_K + FOLD)
        tl.store(wts_ptr + out, weights, mask=mask)
        tl.store(ids_ptr + out, ids, mask=mask)


@triton.jit
def _router_kernel(x_ptr, w_ptr, ws_ptr, cnt_ptr, wts_ptr, ids_ptr, gate_ptr, T, N, K, E, K_SPLIT, programs,
                   stride_xt, stride_wn, TOP_K: tl.constexpr, RENORM: tl.constexpr, HAS_GATE: tl.constexpr,
                   FOLD: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr, PDL: tl.constexpr):
    """Partial logits of BLOCK_N router rows over one slice of H for every token, then (last program) the routing;
    see the module docstring. Grid (cdiv(N, BLOCK_N), SPLIT)."""
    if PDL:  # x is the previous kernel's output (kernels/pdl.py)
        gdc_wait()
    offs_n, n_mask, offs_k, w_ptrs, _ = weight_tile(w_ptr, N, stride_wn, 0, BLOCK_N, BLOCK_K)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    w_ptrs += k_begin
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    if USE_DOT:
        x_ptrs = x_ptr + offs_t[None, :] * stride_xt + (k_begin + offs_k)[:, None]      # x^T [BLOCK_K, BLOCK_T]
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    else:
        x_ptrs = x_ptr + k_begin + offs_k                                                 # token 0's [BLOCK_K]
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # Weights are streamed once: evict_first keeps them from pushing x (read by every program) out of L2.
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            if USE_DOT:
                xv = tl.load(x_ptrs, mask=t_mask[None, :], other=0.0)
            else:
                xv = tl.load(x_ptrs)
        else:
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
            if USE_DOT:
                xv = tl.load(x_ptrs, mask=k_mask[:, None] & t_mask[None, :], other=0.0)
            else:
                xv = tl.load(x_ptrs, mask=k_mask, other=0.0)
        if USE_DOT:
            if DOT_F32:
                acc = tl.dot(w.to(tl.float32), xv.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xv.to(w.dtype), acc)
        else:
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:  # the weights are read: the next kernel may launch (it waits for this whole grid)
        gdc_launch_dependents()
    if USE_DOT:
        part = acc
    else:
        part = tl.sum(acc, axis=1)[:, None]
    ws = ws_ptr + (tl.program_id(1) * T + offs_t[None, :]).to(tl.int64) * N + offs_n[:, None]
    tl.store(ws, part, mask=n_mask[:, None] & t_mask[None, :])
    tl.debug_barrier()                      # every thread's partials are issued before the release below
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == programs - 1:
        _route_tokens(ws_ptr, wts_ptr, ids_ptr, gate_ptr, T, N, E, x_ptr.dtype.element_ty, TOP_K, RENORM, HAS_GATE,
                      FOLD, SPLIT, ROWS, BLOCK_E, BLOCK_KS)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


def supported(x: torch.Tensor, weight: torch.Tensor, top_k: int, num_experts: int, fold_shared: bool = False
              ) -> bool:
    """Whether `moe_router` takes these arguments: x [T, H] with 1 <= T <= MAX_TOKENS, a row-major W [E or E + 1, H]
    (E + 1 to fold the shared expert) in a dtype pair the GEMV handles (`gemv.supported`), E <= 512 and top_k <=
    min(E, 16) (16 pairs with the folded shared one)."""
    rows = (num_experts + 1,) if fold_shared else (num_experts, num_experts + 1)
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS and weight.dim() == 2 and weight.shape[1] == x.shape[1]
            and weight.shape[0] in rows and weight.stride(1) == 1 and 1 <= num_experts <= MAX_EXPERTS
            and 1 <= top_k <= min(num_experts, MAX_TOP_K - fold_shared) and gemv.supported(x, weight))


def default_config(tokens: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> RouterConfig:
    """The tile for `tokens` tokens of x."""
    if tokens == 1:
        return ONE_ROW
    return FEW_ROWS_F32 if torch.float32 in (x_dtype, w_dtype) else FEW_ROWS


def moe_router(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, num_experts: int,
               fold_shared: bool = False, config: RouterConfig | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`moe_router_ref`'s contract in one launch: x [T, H] (1 <= T <= 16), weight [E or E + 1, H] -> (weights
    [T, top_k] fp32, ids [T, top_k] int32, shared_logit [T, 1] in x's dtype, or None for E rows); `fold_shared`
    (E + 1 rows): [T, top_k + 1] weights and ids ending with the shared expert's pair, no logit. ValueError for
    arguments `supported` refuses. `config` forces a tile and split (tests)."""
    check_device(x)
    if not supported(x, weight, top_k, num_experts, fold_shared):
        raise ValueError(f"moe_router: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} "
                         f"(strides {weight.stride()}), top_k {top_k}, {num_experts} experts"
                         f"{', the shared expert folded' if fold_shared else ''}: not a case it takes")
    if x.stride(1) != 1:
        x = x.contiguous()
    tokens, hidden = x.shape
    rows = weight.shape[0]
    dev = x.device
    width = top_k + fold_shared
    weights = torch.empty(tokens, width, dtype=torch.float32, device=dev)
    ids = torch.empty(tokens, width, dtype=torch.int32, device=dev)
    gate = torch.empty(tokens, 1, dtype=x.dtype, device=dev) if rows > num_experts and not fold_shared else None
    cfg = config or default_config(tokens, x.dtype, weight.dtype)
    if tokens > 1 and not cfg.use_dot:
        raise ValueError("the one-row FMA loop computes one token; use a DOT config for several")
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(hidden)))
    tiles = triton.cdiv(rows, cfg.block_n)
    split, per_split = plan(tiles, triton.cdiv(hidden, block_k), cfg.split, sm_count(dev), MIN_STEPS)
    workspace = torch.empty(split, tokens, rows, dtype=torch.float32, device=dev)
    block_e = triton.next_power_of_2(num_experts)
    block_t = 16 if cfg.use_dot else 1
    dot_f32 = torch.float32 in (x.dtype, weight.dtype) or interpreting()
    pdl = use_pdl(x)
    _router_kernel[(tiles, split)](
        x, weight, workspace, counters(dev)[ROUTER_COUNTER:], weights, ids, weights if gate is None else gate,
        tokens, rows, hidden, num_experts, per_split * block_k, tiles * split, x.stride(0), weight.stride(0),
        TOP_K=top_k, RENORM=renormalize, HAS_GATE=rows > num_experts, FOLD=fold_shared, SPLIT=split,
        USE_DOT=cfg.use_dot,
        DOT_F32=dot_f32, BLOCK_T=block_t, BLOCK_N=cfg.block_n, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0,
        ROWS=min(triton.next_power_of_2(tokens), max(1, ROUTE_VALUES // block_e)), BLOCK_E=block_e,
        BLOCK_KS=triton.next_power_of_2(width), PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=pdl)
    return weights, ids, gate
