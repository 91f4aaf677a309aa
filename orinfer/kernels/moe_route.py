"""MoE router: softmax over the experts, top-k and renormalisation in one kernel (`moe_route_ref`'s contract).

Math, per token t (row of router_logits [T, E], any float dtype, E <= 512), in fp32:

    m = max_e x[e];  p[e] = exp(x[e] - m) / sum_e' exp(x[e'] - m)
    ids[t, :] = the top_k experts by x (softmax is monotonic), ties to the lower id; weights[t, j] = p[ids[t, j]]
    renormalize: weights[t, :] /= sum_j weights[t, j]

Outputs weights [T, k] fp32 and ids [T, k] int32 (k <= 16). With a folded shared expert's gate logits g [T, 1]
(`shared_logit`) every row gets a (k+1)-th pair, weights[t, k] = sigmoid(g[t]) in fp32 and ids[t, k] = E, after the
renormalisation (which sums the routed k alone): [T, k + 1] each, k + 1 <= 16. The choice is made on the logits, not on the rounded
probabilities: equal logits go to the lower id as torch.topk does; two different logits whose fp32 probabilities
happen to round to the same value (|x| below ~1e-7 apart) are ordered by the logits, where the reference would take
the lower id (same weight either way).

Any row, whatever its values, gets k distinct ids in 0..E-1: NaN logits count as -inf (below every number), so a row
of NaN or -inf picks experts 0..k-1 (its weights are then NaN: garbage in, garbage out, but only in that row). This
matters under CUDA graphs: a mixed-step graph's padding rows (past the step's real tokens) hold whatever attention
left unwritten there (kernels/extend_attention.py), often NaN after the norms; an all-NaN row used to match no expert
and pick id BLOCK_E (>= E) k times, and the expert kernels then indexed weights, offsets and sorted lists out of
bounds: the illegal memory access of the MoE graph capture (benchmarks/NOTES.md, run 284). Eager steps have no padding
rows, so they never saw it. (The reference sorts NaN first; no real row has one.)

Kernel: a program owns BLOCK_T rows and holds each as a [BLOCK_E] fp32 register row (E padded to a power of two with
-inf); k rounds of one max over keys that pack each logit with its index (`route_rows`) pick the experts.
Traffic: T*E logits read, T*k*8 bytes written: a few microseconds at any batch; one launch, no host sync (CUDA-graph
safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl

MAX_EXPERTS = 512
MAX_TOP_K = 16


@triton.jit
def _order_keys(x, offs_e, BLOCK_E: tl.constexpr):
    """One int64 per logit whose integer order is the pick order: the fp32 bits made monotonic (a negative float's
    magnitude bits flipped) in the high word, BLOCK_E - 1 - index in the low word, so that of equal logits the lower
    index has the larger key. One max over these finds both the best logit and its lowest index."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - offs_e).to(tl.int64)


@triton.jit
def route_rows(x, pad, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """The routing of a block of rows: x [R, BLOCK_E] fp32 logits, pad [1, BLOCK_E] (columns >= E, which must hold
    -inf in x) -> (weights [R, BLOCK_K] fp32, ids [R, BLOCK_K] int32), the columns >= TOP_K zero. The module
    docstring's math, tie and NaN rules; `kernels/moe_router.py` runs it on logits it computed itself.

    Each pick is one max over `_order_keys` (the logit and, among equal ones, the lowest index together): a
    reduction across the program's warps costs a shared-memory round trip and a barrier, and at batch 1 the k picks
    are the router's critical path (three reductions a pick before: max, lowest index, probability)."""
    # NaN ranks below every number: without this an all-NaN row (a CUDA-graph padding row's garbage) matches no
    # expert and picks id BLOCK_E, out of range for the expert kernels (see the module docstring).
    x = tl.where(x == x, x, float("-inf"))
    offs_e = tl.arange(0, BLOCK_E)
    m = tl.max(x, axis=1)
    total = tl.sum(tl.exp(x - m[:, None]), axis=1)              # padding: exp(-inf) = 0
    # Padding gets the lowest key of all: even a row of -inf logits (whose keys are above it) picks real experts.
    keys = tl.where(pad, -0x7FFFFFFFFFFFFFFF - 1, _order_keys(x, offs_e[None, :], BLOCK_E))
    offs_k = tl.arange(0, BLOCK_K)
    weights = tl.zeros([x.shape[0], BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([x.shape[0], BLOCK_K], dtype=tl.int32)
    for j in range(TOP_K):
        best = tl.max(keys, axis=1)
        pick = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        high = (best >> 32).to(tl.int32)
        logit = (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)   # the key's fp32 bits back
        keys = tl.where(offs_e[None, :] == pick[:, None], -0x7FFFFFFFFFFFFFFF - 1, keys)
        p = tl.exp(logit - m) / total                          # the same exp(x - m) as the total's term
        weights = tl.where(offs_k[None, :] == j, p[:, None], weights)
        ids = tl.where(offs_k[None, :] == j, pick[:, None], ids)
    if RENORM:
        weights = weights / tl.sum(weights, axis=1)[:, None]     # slots >= TOP_K hold 0
    return weights, ids


@triton.jit
def append_shared(weights, ids, logit, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """`route_rows`' weights and ids [R, BLOCK_K] with the shared expert's pair in column TOP_K (which must be <
    BLOCK_K): weight sigmoid(logit) (logit [R] fp32, rounded as the reference's dtype already), id E."""
    last = tl.arange(0, BLOCK_K)[None, :] == TOP_K
    weights = tl.where(last, tl.sigmoid(logit)[:, None], weights)
    return weights, tl.where(last, E, ids)


@triton.jit
def _moe_route_kernel(logits_ptr, gate_ptr, w_ptr, ids_ptr, T, E, stride_t, stride_g, TOP_K: tl.constexpr,
                      RENORM: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # Rows past T read row T - 1 (never stored), so every row has a finite maximum.
    src = tl.minimum(rows, T - 1).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    pad = offs_e[None, :] >= E
    x = tl.load(logits_ptr + src[:, None] * stride_t + offs_e[None, :], mask=~pad, other=float("-inf"))
    x = x.to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    weights, ids = route_rows(x, pad, TOP_K, RENORM, BLOCK_E, BLOCK_K)
    if SHARED:
        logit = tl.load(gate_ptr + src * stride_g).to(tl.float32)
        weights, ids = append_shared(weights, ids, logit, E, TOP_K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    out = rows.to(tl.int64)[:, None] * (TOP_K + SHARED) + offs_k[None, :]
    mask = (rows[:, None] < T) & (offs_k[None, :] < TOP_K + SHARED)
    tl.store(w_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool, shared_logit: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (fp32/fp16/bf16, unit last stride) -> (weights [T, top_k] fp32, ids [T, top_k] int32),
    as `moe_route_ref`; E <= 512 and top_k <= 16. `shared_logit` [T, 1] (any strides): the shared expert's pair
    appended (module docstring), [T, top_k + 1] each, top_k + 1 <= 16."""
    check_device(router_logits)
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    tokens, experts = router_logits.shape
    shared = shared_logit is not None
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"moe_route handles 1..{MAX_EXPERTS} experts, got {experts}")
    if not 1 <= top_k <= min(experts, MAX_TOP_K - shared):
        raise ValueError(f"top_k must be in 1..min(E, {MAX_TOP_K}{' - 1 (the shared pair)' if shared else ''}), got "
                         f"{top_k} for E = {experts}")
    if router_logits.dtype not in _FLOATS or (shared and shared_logit.dtype not in _FLOATS):
        raise ValueError(f"router_logits and shared_logit must be float tensors, got {router_logits.dtype}"
                         f"{f' and {shared_logit.dtype}' if shared else ''}")
    if shared and tuple(shared_logit.shape) != (tokens, 1):
        raise ValueError(f"shared_logit must be [T, 1] = [{tokens}, 1], got {tuple(shared_logit.shape)}")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    width = top_k + shared
    weights = torch.empty(tokens, width, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, width, dtype=torch.int32, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(experts)
    block_t = min(triton.next_power_of_2(tokens), max(1, 4096 // block_e))   # ~4K fp32 values per program
    pdl = use_pdl(router_logits)
    _moe_route_kernel[(triton.cdiv(tokens, block_t),)](
        router_logits, shared_logit if shared else router_logits, weights, ids, tokens, experts,
        router_logits.stride(0), shared_logit.stride(0) if shared else 0, TOP_K=top_k, RENORM=renormalize,
        SHARED=shared, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(width), PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    return weights, ids
