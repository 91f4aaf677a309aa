"""The multi-row FMA loop of the decode GEMV: y = x W^T (+ b) for 2..8 rows of x, each weight tile loaded once.

Who needs it: a speculative verify step (k draft tokens + 1 rows a sequence: MTP k = 3 at batch 1 is 4 rows, a draft
model or n-gram at k = 4 is 5) and small decode batches. The tensor-core loop of `gemv._gemv_kernel` pads x to 16
rows whatever the count; this loop does ROWS rows of FMA work and reads the weight once, so a handful of rows should
cost close to one row's weight read (the GEMV is bandwidth-bound until the FMA work per weight catches up: about 8
SASS instructions per weight at 4 rows against ~4 for one row, measured by compiling for sm_90, see below).

Math (as the other loops of `gemv`): x [B, K], W [N, K] row-major, b [N]; products and sums in fp32, the result
rounded once to x's dtype. Mixed mode (fp32 x, 16-bit W) widens W as it is loaded. GATED: W is the packed [2I, K]
gate/up weight; the program reads gate rows n and up rows I + n and writes silu(g) * u (`gemv_epilogue`).

Per program: BLOCK_N output rows. Per K step it loads the [BLOCK_N, BLOCK_K] weight tile once (16-byte vectors
along K, evict-first) and, for each of the ROWS rows of x, the row's [BLOCK_K] slice, then adds w * x_r into row r's
accumulator. Rows past B (ROWS > B) re-read row B - 1 and are not stored, so no load needs a row mask.

Registers, the reason for the accumulator shape: the one-row loop keeps a full [BLOCK_N, BLOCK_K] fp32 accumulator
(one register per weight a thread holds) and reduces along K once at the end. ROWS such accumulators would need ROWS
registers per weight: with the one-row tile (2 x 2048, 2 warps: 64 weights a thread) that is 512 at 8 rows. Instead,
each step reduces every product tile over its 16-byte vectors (VEC = 8 bf16/fp16 or 4 fp32 weights, all in one
thread, so the sum is in-register: a chain of FMAs, no shuffles) into a [BLOCK_N, BLOCK_K // VEC] accumulator per row:
ROWS / VEC registers per weight, one FMUL + one FADD per VEC products more than plain FMAs. Reducing a row's products
all the way along K every step would need cross-lane shuffles and a shared-memory barrier per step instead.
x: each row's slice is loaded 1-D; with BLOCK_K = 256 * num_warps (or a multiple) the 1-D load's layout is exactly the
column layout of the weight tile (8 consecutive k per thread, all warps along K), so x needs no shared-memory exchange
per step (smaller BLOCK_K would add one barrier per step, as in the one-row loop's small tiles). Each thread then
holds BLOCK_N weight rows for the same 8 k, so one x value serves BLOCK_N weights.

Codegen for sm_90 (ptxas via `kernels.sm90`, bf16, non-gated; instructions of the loop body per weight a thread
loads): 4 rows: (4, 1024, 4) 72 registers, 9.3 instructions per weight; (8, 1024, 4) 128, 8.0. 8 rows: 109 / 16.1 and
168 / 13.7. The one-row loop: 125 registers, 3.8. At 4.3 TB/s an H200 streams ~2.15 T bf16 weights per second and
issues ~30 T thread instructions, so 4 rows should stay bandwidth-bound while 8 rows probably will not (the
tensor-core loop may win there): the tuner measures.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait

MAX_FMA_ROWS = 8


@triton.jit
def weight_tile(w_ptr, N, stride_wn, up_offset, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's BLOCK_N output rows (offsets, mask) and the pointers of its first [BLOCK_N, BLOCK_K] weight
    tile: gate rows n, and up rows up_offset + n (GATED; unused otherwise). Rows past N are clamped to N-1 (read
    twice, never stored), so the weight loads need no row mask."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    wg_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    wu_ptrs = w_ptr + (rows + up_offset)[:, None] * stride_wn + offs_k[None, :]
    return offs_n, offs_n < N, offs_k, wg_ptrs, wu_ptrs


@triton.jit
def gemv_epilogue(g, u, out_ptrs, mask, act_ty: tl.constexpr, GATED: tl.constexpr):
    """Stores an fp32 output tile g (bias already added) rounded to act_ty; GATED: stores silu(g) * u instead, with g
    and u rounded to act_ty first and silu rounded before the product, exactly as the unfused GEMM + `silu_and_mul`."""
    if GATED:
        g = g.to(act_ty).to(tl.float32)
        u = u.to(act_ty).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(act_ty).to(tl.float32)
        g = s * u
    tl.store(out_ptrs, g.to(act_ty).to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _vec_dot(w, x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] * x [1, BLOCK_K] summed over each run of VEC consecutive k: [BLOCK_N, BLOCK_K // VEC].
    A run is one thread's 16-byte vector, so this is an in-register FMA chain."""
    return tl.sum(tl.reshape(w * x, [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2)


@triton.jit
def _add_at(acc, r: tl.constexpr, value):
    """The tuple `acc` with value added to its element r (Triton tuples have no item assignment)."""
    return acc[:r] + (acc[r] + value,) + acc[r + 1:]


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, b_ptr, out_ptr, B, N, K, stride_xb, stride_wn, stride_ob, up_offset,
                      HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, VEC: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """out[r, n] = sum_k x[r, k] W[n, k] (+ b[n]) for r < B <= ROWS; see the module docstring. Grid (cdiv(N, BLOCK_N),).
    Traffic: N*K weights (2N*K gated) once, x (B*K) once per program (L2), B*N outputs."""
    if PDL:  # see kernels/pdl.py: wait for the previous kernel before touching memory
        gdc_wait()
    offs_n, n_mask, offs_k, wg_ptrs, wu_ptrs = weight_tile(w_ptr, N, stride_wn, up_offset, BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + offs_k
    zero = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc_g = (zero,) * ROWS  # one accumulator per row of x (gate rows when GATED)
    acc_u = (zero,) * ROWS  # up rows (GATED only)
    for k0 in range(0, K, BLOCK_K):
        # Weights are streamed once: evict_first keeps them from pushing x (re-read by every program) out of L2.
        if EVEN_K:
            wg = tl.load(wg_ptrs, eviction_policy="evict_first").to(tl.float32)
            if GATED:
                wu = tl.load(wu_ptrs, eviction_policy="evict_first").to(tl.float32)
        else:
            k_mask = (k0 + offs_k) < K
            wg = tl.load(wg_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32)
            if GATED:
                wu = tl.load(wu_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32)
        for r in tl.static_range(ROWS):
            xr_ptrs = x_ptrs + tl.minimum(r, B - 1) * stride_xb  # rows past B re-read row B-1, never stored
            if EVEN_K:
                xr = tl.load(xr_ptrs).to(tl.float32)[None, :]
            else:
                xr = tl.load(xr_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            acc_g = _add_at(acc_g, r, _vec_dot(wg, xr, BLOCK_N, BLOCK_K, VEC))
            if GATED:
                acc_u = _add_at(acc_u, r, _vec_dot(wu, xr, BLOCK_N, BLOCK_K, VEC))
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:  # the main loop is done: let the next kernel launch while this one reduces and stores
        gdc_launch_dependents()
    act_ty = x_ptr.dtype.element_ty  # the result rounds to x's dtype, whatever dtype it is stored in
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    for r in tl.static_range(ROWS):
        g = tl.sum(acc_g[r], axis=1)
        u = tl.sum(acc_u[r], axis=1)
        if HAS_BIAS:
            g += bias
        gemv_epilogue(g, u, out_ptr + r * stride_ob + offs_n, n_mask & (r < B), act_ty, GATED)


def launch_gemv_rows(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                     gated: bool, block_n: int, block_k: int, num_warps: int, pdl: bool,
                     rows_constexpr: int | None = None) -> None:
    """Writes x2 [B, K] W^T (+ b) (gated: silu(gate) * up) into out [B, n_out]; 1 <= B <= MAX_FMA_ROWS.

    The kernel is compiled for ROWS = B (`rows_constexpr` forces a larger ROWS, the extra rows masked: tests): the FMA
    work grows with ROWS, so 5 rows (a k = 4 verify step) should not pay for 8."""
    rows, k = x2.shape
    n_out = out.shape[1]
    if not 1 <= rows <= MAX_FMA_ROWS:
        raise ValueError(f"the multi-row FMA loop takes 1..{MAX_FMA_ROWS} rows, got {rows}")
    vec = min(16 // weight.element_size(), block_k)  # one thread's 16-byte vector of weights
    _gemv_rows_kernel[(triton.cdiv(n_out, block_n),)](
        x2, weight, out if bias is None else bias, out, rows, n_out, k, x2.stride(0), weight.stride(0),
        out.stride(0), n_out if gated else 0,
        HAS_BIAS=bias is not None, GATED=gated, ROWS=max(rows, rows_constexpr or rows), BLOCK_N=block_n,
        BLOCK_K=block_k, VEC=vec, EVEN_K=k % block_k == 0, num_warps=num_warps, num_stages=1, PDL=pdl,
        launch_pdl=pdl)
