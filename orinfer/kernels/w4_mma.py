"""INT4 matmul on tensor cores over the W4 layout (`kernels.w4`): decode batches of 2..64 rows.

Math: y [M, N] = x [M, K] W^T (+ b), W[n, k] = (q - z) * s per group (group size a multiple of 128). A chunk is the
8R = 128 inputs of one int32 column block [BLOCK_N, R = 16]: nibble p of int32 r is input p*R + r of the chunk, so the
eight nibbles of the tile are eight [BLOCK_N, 16] weight slices, each matching one contiguous slice of x. Per chunk:

    part = sum_p dot(q_p - z, x_p^T)     eight K = 16 tensor-core steps, weight first (swap-AB), fp32 accumulate
    acc += part * s[group]               per output row, once per chunk

The weight is the MMA's M side (128 rows per warpgroup: two m64 wgmmas per step), the few rows of x its N side (16 at
least). `_unpack_asm` turns each pair of int32 into 16-bit pairs q - z with one lop3 and one fma per two weights
(exact: small integers), and because the slices come out of an elementwise op on the loaded tile, Triton applies it
to the registers the wgmma reads: the int32 tile is the only thing staged in shared memory. (Unpacking into one
[BLOCK_N, 128] tile instead needs a reshape, which Triton lowers to a round trip of the 16-bit tile through shared
memory: four times the weight bytes, 1.5-2x slower; tests/test_w4_codegen.py guards this.) No weight is
rounded: up to summation order the result is the fp32 reference's. fp32 x and the CPU interpreter (which runs no
PTX) take the same slices in fp32 with exact fp32 dots.

Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT). Split-K: a decode GEMM has only N/BLOCK_N tiles (48 for qkv at
BLOCK_N 128), too few programs to keep enough bytes in flight, so program (tile, s) takes chunks s*C .. (s+1)*C - 1
and stores fp32 partial sums (gate and up separately) in a workspace [SPLIT, 2, M, N_OUT]; `_w4_splitk_reduce_kernel`
sums them in a fixed order (deterministic, no atomics) and applies the epilogue. x, zero points and scales are loaded
one chunk ahead (PREFETCH); the weight tiles are pipelined by the compiler. Rows beyond M repeat the last row and are
not stored; rows beyond N repeat the last row of W. GATED: the packed gate_up weight [2I, K/8]; a program multiplies
the gate rows n and the up rows I + n and stores silu(g) * u with the unfused path's roundings (`tiles.epilogue`).
Traffic: N*K*(0.5 + 3/G) weight bytes per BLOCK_M rows + M*K*2 + M*N*2, plus SPLIT*M*N*8 of partial sums (mostly in
L2). Measured at 16 rows on the H200: 27-41% of the read bandwidth, 66 us per Qwen3-8B layer (earlier forms: 117 us).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device, interpreting
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.w4 import W4Weight
from orinfer.kernels.tiles import epilogue, grouped_tile, store_tile


def _unpack_asm(magic: int, one: int, ptx_type: str, subtract: bool = True) -> str:
    """PTX for one pair of int32 words that the MMA operand's registers hold side by side (inputs k and k + 1 of one
    weight row): the eight 16-bit pairs (q_p(k) - z, q_p(k + 1) - z), p = 0..7, in outputs $0..$7. prmt gathers byte
    p // 2 of both words into the two 16-bit halves; lop3 keeps nibble p (after a shift by 4 for odd p) and ORs in the
    exponent bits of B, giving the exact value B + q; an fma adds $10, which holds -(B + z) in both halves (the value
    is exact: a small integer). Two weights per lop3 and per fma, one prmt and one shift per four: 1.5 instructions
    per weight, where unpacking one code per 16-bit element costs ~3. fma.rn.bf16x2 needs sm_80 or newer. Without
    `subtract`: B + q, no fma and no $10 (for a kernel that takes the zero point out after the MMA)."""
    lines = ["{", ".reg .b32 t<4>, one;", f"mov.b32 one, {one:#x};"]
    for b in range(4):
        lines.append(f"prmt.b32 t{b}, $8, $9, 0x{4 + b:x}{4 + b:x}{b:x}{b:x};")
    for odd in (0, 1):
        for b in range(4):
            if odd:
                lines.append(f"shr.u32 t{b}, t{b}, 4;")
            out = f"${2 * b + odd}"
            lines.append(f"lop3.b32 {out}, t{b}, 0x000F000F, {magic:#x}, 0xEA;")
            if subtract:
                lines.append(f"fma.rn.{ptx_type} {out}, {out}, one, $10;")
    return "\n".join(lines + ["}"])


# B = 128 in bf16 (0x4300), 1024 in fp16 (0x6400), twice per word; `one` is 1.0 twice
_UNPACK_BF16 = tl.constexpr(_unpack_asm(0x43004300, 0x3F803F80, "bf16x2"))
_UNPACK_FP16 = tl.constexpr(_unpack_asm(0x64006400, 0x3C003C00, "f16x2"))


@triton.jit
def _nibble(w, P: tl.constexpr):
    return ((w >> (4 * P)) & 15).to(tl.float32)


@triton.jit
def _weight_slices(w, z, PLAIN: tl.constexpr, FP16: tl.constexpr):
    """int32 tile [BLOCK_N, R] and zero points z [BLOCK_N] -> the eight [BLOCK_N, R] operand tiles q_p - z (nibble p
    of each int32: the chunk's inputs p*R .. p*R + R - 1), exact. Compiled with 16-bit x: in x's dtype through
    `_unpack_asm` (Triton hoists this elementwise op above the operand's layout change, so it runs on the registers
    the tensor cores read: no shared-memory round trip of the 16-bit tile). PLAIN (fp32 x, or the CPU interpreter,
    which runs no PTX): fp32 values."""
    if PLAIN:
        zf = z.to(tl.float32)[:, None]
        return (_nibble(w, 0) - zf, _nibble(w, 1) - zf, _nibble(w, 2) - zf, _nibble(w, 3) - zf,
                _nibble(w, 4) - zf, _nibble(w, 5) - zf, _nibble(w, 6) - zf, _nibble(w, 7) - zf)
    else:
        neg = z.to(tl.int32) | (0xE400 if FP16 else 0xC300)            # -(B + z) as a 16-bit float's bits
        nz = tl.broadcast_to(((neg << 16) | neg)[:, None], w.shape)     # ... in both halves of a 32-bit word
        if FP16:
            return tl.inline_asm_elementwise(_UNPACK_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [w, nz],
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_UNPACK_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [w, nz],
                                             dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)


@triton.jit
def _x_slices(x_ptrs, R: tl.constexpr, PLAIN: tl.constexpr):
    """The chunk's x as eight [BLOCK_M, R] slices (inputs p*R .. p*R + R - 1), fp32 when PLAIN."""
    xs = (tl.load(x_ptrs), tl.load(x_ptrs + R), tl.load(x_ptrs + 2 * R), tl.load(x_ptrs + 3 * R),
          tl.load(x_ptrs + 4 * R), tl.load(x_ptrs + 5 * R), tl.load(x_ptrs + 6 * R), tl.load(x_ptrs + 7 * R))
    if PLAIN:
        xs = (xs[0].to(tl.float32), xs[1].to(tl.float32), xs[2].to(tl.float32), xs[3].to(tl.float32),
              xs[4].to(tl.float32), xs[5].to(tl.float32), xs[6].to(tl.float32), xs[7].to(tl.float32))
    return xs


@triton.jit
def _group_zero_scale(zp_ptr, sc_ptr, sz_off):
    """(zero point, fp32 scale) [BLOCK_N] of one chunk's group."""
    return tl.load(zp_ptr + sz_off), tl.load(sc_ptr + sz_off).to(tl.float32)


@triton.jit
def _chunk_dot(acc, xs, w_ptrs, zs, PLAIN: tl.constexpr, FP16: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + s * sum_p dot(q_p - z, x_p^T) for one chunk (one group's 8R inputs or part of them):
    eight K = R tensor-core steps with the weight slices as the first operand, fp32 accumulate, then the group's
    scale once per output row; zs = (z, s) from `_group_zero_scale`."""
    a = _weight_slices(tl.load(w_ptrs), zs[0], PLAIN, FP16)
    if PLAIN:
        part = tl.dot(a[0], xs[0], input_precision="ieee")
        for p in tl.static_range(1, 8):
            part = tl.dot(a[p], xs[p], part, input_precision="ieee")
    else:
        part = tl.dot(a[0], xs[0])
        for p in tl.static_range(1, 8):
            part = tl.dot(a[p], xs[p], part)
    return acc + part * zs[1][:, None]


@triton.jit
def _w4_mma_kernel(x_ptr, qw_ptr, sc_ptr, zp_ptr, b_ptr, out_ptr, ws_ptr, M, N_OUT, K8, stride_xm, stride_om,
                   stride_qw, stride_sg, UP, CHUNKS_PER_SPLIT, G8: tl.constexpr, R: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PLAIN: tl.constexpr, FP16: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
                   PREFETCH: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    rn = tl.minimum(offs_n, N_OUT - 1).to(tl.int64)
    offs_r = tl.arange(0, R)
    x_ptrs = x_ptr + offs_r[:, None] + rm[None, :] * stride_xm     # x^T slices [R, BLOCK_M]
    wg_ptrs = qw_ptr + rn[:, None] * stride_qw + offs_r[None, :]
    wu_ptrs = wg_ptrs + UP * stride_qw
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)    # transposed: the weight is the dot's first operand
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = 0
    k_hi = K8
    if SPLIT > 1:                                                # this program's share of the chunks
        k_lo = tl.program_id(1) * CHUNKS_PER_SPLIT * R
        k_hi = tl.minimum(k_lo + CHUNKS_PER_SPLIT * R, K8)
    # PREFETCH: x and the group's zero points and scales are loaded one chunk ahead (the compiler pipelines the
    # weight tile through shared memory, not these small loads, and each would stall the chunk for a memory latency)
    sz = rn * stride_sg
    xs = _x_slices(x_ptrs + k_lo * 8, R, PLAIN)
    zs_g = _group_zero_scale(zp_ptr, sc_ptr, sz + k_lo // G8)
    zs_u = zs_g
    if GATED:
        zs_u = _group_zero_scale(zp_ptr, sc_ptr, sz + UP * stride_sg + k_lo // G8)
    for c0 in range(k_lo, k_hi, R):                              # one chunk of 8R inputs per step
        c1 = c0
        if PREFETCH:
            c1 = tl.minimum(c0 + R, k_hi - R)                    # the next chunk (the last one reloads itself)
        xs_next = _x_slices(x_ptrs + c1 * 8, R, PLAIN)
        zs_g_next = _group_zero_scale(zp_ptr, sc_ptr, sz + c1 // G8)
        zs_u_next = zs_g_next
        if GATED:
            zs_u_next = _group_zero_scale(zp_ptr, sc_ptr, sz + UP * stride_sg + c1 // G8)
        if not PREFETCH:
            xs = xs_next
            zs_g = zs_g_next
            zs_u = zs_u_next
        acc_g = _chunk_dot(acc_g, xs, wg_ptrs + c0, zs_g, PLAIN, FP16)
        if GATED:
            acc_u = _chunk_dot(acc_u, xs, wu_ptrs + c0, zs_u, PLAIN, FP16)
        xs = xs_next
        zs_g = zs_g_next
        zs_u = zs_u_next
    acc_g = tl.trans(acc_g)
    acc_u = tl.trans(acc_u)
    if PDL:
        gdc_launch_dependents()
    mask = (offs_m < M)[:, None] & (offs_n < N_OUT)[None, :]
    if SPLIT > 1:                                                # raw partial sums; the reduce kernel finishes
        part = ws_ptr + (tl.program_id(1) * 2 * M + offs_m[:, None]) * N_OUT + offs_n[None, :]
        tl.store(part, acc_g, mask=mask)
        if GATED:
            tl.store(part + M * N_OUT, acc_u, mask=mask)
    else:
        store_tile(out_ptr, acc_g, acc_u, b_ptr, rn, offs_m, offs_n, mask, stride_om, HAS_BIAS, GATED, FP16)


@triton.jit
def _w4_splitk_reduce_kernel(ws_ptr, b_ptr, out_ptr, M, N_OUT, stride_om, SPLIT: tl.constexpr,
                             HAS_BIAS: tl.constexpr, GATED: tl.constexpr, CLAMP16: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = epilogue(sum_s ws[s, 0, m, n], sum_s ws[s, 1, m, n]) for one row m and BLOCK columns per program;
    grid (M, cdiv(N_OUT, BLOCK)). Reads SPLIT * (1 + GATED) * 4 bytes and writes 2 bytes per output."""
    if PDL:
        gdc_wait()
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N_OUT
    g = tl.zeros([BLOCK], dtype=tl.float32)
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):                             # fixed order: deterministic sums
        row = ws_ptr + (s * 2 * M + m) * N_OUT + offs
        g += tl.load(row, mask=mask, other=0.0)
        if GATED:
            u += tl.load(row + M * N_OUT, mask=mask, other=0.0)
    if PDL:
        gdc_launch_dependents()
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + m.to(tl.int64) * stride_om + offs, epilogue(g, u, bias, out_ty, HAS_BIAS, GATED, CLAMP16),
             mask=mask)


class W4MmaConfig(NamedTuple):
    block_m: int         # rows of x per tile (the wgmma's N side: 16 is the smallest)
    block_n: int         # output columns per tile (rows of W: the wgmma's M side)
    num_warps: int
    num_stages: int
    split_k: int = 8     # K split over this many programs per tile (then a reduce kernel); 1: one kernel
    prefetch: bool = True  # load x, zero points and scales one chunk ahead


# Measured on the H200 (docs/performance.md), the fastest on all four Qwen3-8B projections
# or within 4% of it. One warpgroup over 128 weight rows (two m64 wgmmas per K step) with the unpack in registers;
# the gated kernel reads two weight tiles per chunk, so it takes half the split. The 32-row tile uses 8 warps and no
# prefetch: with both, the compiler no longer keeps the unpacked operand in registers (tests/test_w4_codegen.py).
DECODE_MMA = W4MmaConfig(16, 128, 4, 3, 8)
DECODE_MMA_GATED = W4MmaConfig(16, 128, 4, 3, 4)
DECODE_MMA_32 = W4MmaConfig(32, 128, 8, 3, 4, prefetch=False)   # more than 16 rows (as fast as 64-row tiles)
MMA_CONFIGS = [W4MmaConfig(*c) for c in [(16, 128, 4, 3, 8), (16, 128, 4, 3, 4), (16, 128, 4, 3, 16),
                                         (16, 128, 4, 4, 8), (16, 128, 4, 3, 8, False), (16, 64, 4, 3, 8, False),
                                         (16, 64, 4, 3, 4, False), (32, 128, 8, 3, 4, False),
                                         (32, 128, 4, 3, 4), (32, 128, 4, 3, 8)]]


def _split_count(split_k: int, chunks: int) -> tuple[int, int]:
    """(splits, chunks per split) with no empty split."""
    per_split = triton.cdiv(chunks, max(1, min(split_k, chunks)))
    return triton.cdiv(chunks, per_split), per_split


def w4_mma(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None, gated: bool = False,
           cfg: W4MmaConfig | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] (gated: [..., N/2] = silu(gate) * up) in x's dtype, on tensor cores."""
    check_device(x)
    k, n = w.in_features, w.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match in_features {k}")
    if w.group_size % 128:
        raise ValueError(f"w4_mma needs a group size that is a multiple of 128, got {w.group_size}")
    n_out = n // 2 if gated else n
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n_out} outputs")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n_out)
    cfg = cfg or (DECODE_MMA_32 if m > 16 else DECODE_MMA_GATED if gated else DECODE_MMA)
    pdl = use_pdl(x2)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_out, cfg.block_n)
    split, per_split = _split_count(cfg.split_k, k // 8 // w.chunk_int32)
    ws = torch.empty(split, 2, m, n_out, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (tiles, split)
    bias_arg = bias if bias is not None else out
    _w4_mma_kernel[grid](
        x2, w.packed, w.scales, w.zeros, bias_arg, out, ws, m, n_out, k // 8, x2.stride(0), out.stride(0),
        w.packed.stride(0), w.scales.stride(0), n_out if gated else 0, per_split, G8=w.group_size // 8,
        R=w.chunk_int32, HAS_BIAS=bias is not None, GATED=gated, PLAIN=x.dtype == torch.float32 or interpreting(),
        FP16=x.dtype == torch.float16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=8, SPLIT=split,
        PREFETCH=cfg.prefetch, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    if split > 1:
        block = 1024
        _w4_splitk_reduce_kernel[(m, triton.cdiv(n_out, block))](
            ws, bias_arg, out, m, n_out, out.stride(0), SPLIT=split, HAS_BIAS=bias is not None, GATED=gated,
            CLAMP16=x.dtype == torch.float16, BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out.reshape(*x.shape[:-1], n_out)


@triton.jit
def _w4_dequant_kernel(qw_ptr, sc_ptr, zp_ptr, out_ptr, N, K8, stride_qw, stride_sg, stride_o,
                       G8: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    """A program: BLOCK_N rows x CHUNKS chunks of R int32 each, loaded at once (CHUNKS * R * 4 contiguous bytes per
    row) and stored at once (CHUNKS * 8R contiguous outputs per row); chunks past K8 are masked."""
    rn = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    p = tl.arange(0, 8)
    r = tl.arange(0, R)
    first = tl.program_id(1) * (CHUNKS * R)                                             # first int32 column
    col = first + c[:, None] * R + r[None, :]                                           # [CHUNKS, R]
    w = tl.load(qw_ptr + rn[:, None, None] * stride_qw + col[None], mask=(col < K8)[None], other=0)
    chunk_in = first + c * R < K8                                                       # [CHUNKS]
    sg = rn[:, None] * stride_sg + ((first + c * R) // G8)[None, :]                     # one group per chunk
    z = tl.load(zp_ptr + sg, mask=chunk_in[None, :], other=0).to(tl.float32)
    s = tl.load(sc_ptr + sg, mask=chunk_in[None, :], other=0).to(tl.float32)
    codes = (w[:, :, None, :] >> (4 * p)[None, None, :, None]) & 15                    # [BLOCK_N, CHUNKS, 8, R]
    q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    val = (q - z[:, :, None, None]) * s[:, :, None, None]
    k = first * 8 + c[:, None, None] * (8 * R) + p[None, :, None] * R + r[None, None, :]  # [CHUNKS, 8, R] inputs
    tl.store(out_ptr + rn[:, None, None, None] * stride_o + k[None], val.to(out_ptr.dtype.element_ty),
             mask=(k < K8 * 8)[None])


def w4_dequantize(w: W4Weight, dtype: torch.dtype = torch.bfloat16, block_n: int = 4, chunks: int = 4,
                  num_warps: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] = (q - z) * s in `dtype` (computed in fp32, rounded once). Reads N*K*(0.5 + 3/G) bytes, writes
    N*K*sizeof(dtype): bandwidth-bound. Grid (cdiv(N, block_n), cdiv(K/8, chunks * R)); tail rows rewrite row N-1
    (same values). The default tile is the best of a sweep on the H200: 68-83% of the copy ceiling on
    Qwen3-8B's projections, 145-148 us per layer (the earlier form, one chunk at a time: 160 us). The dequantisation is
    most of AWQ prefill's gap to bf16 (about 8% of a 2048-token prefill). `out`: a contiguous [N, K] tensor of `dtype`
    to write into (a reused buffer) instead of a new one."""
    check_device(w.packed)
    n, k = w.out_features, w.in_features
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=w.packed.device)
    elif out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous() or out.device != w.packed.device:
        raise ValueError(f"w4_dequantize: out must be a contiguous [{n}, {k}] {dtype} tensor on {w.packed.device}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    r = w.chunk_int32
    _w4_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k // 8, chunks * r))](
        w.packed, w.scales, w.zeros, out, n, k // 8, w.packed.stride(0), w.scales.stride(0), out.stride(0),
        G8=w.group_size // 8, R=r, BLOCK_N=block_n, CHUNKS=chunks, num_warps=num_warps)
    return out
