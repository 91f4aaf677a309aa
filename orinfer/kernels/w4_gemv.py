"""One-row INT4 GEMV over the W4 layout (`kernels.w4`): decode at batch 1, optionally fused with gate/up + SwiGLU.

Math: y[n] = sum_g s[n, g] * (sum_{k in g} q[n, k] x[k]  -  z[n, g] * sum_{k in g} x[k]) (+ b[n]), fp32 throughout,
rounded once to x's dtype (fp16 clamped to +-65504). Zero points and scales leave the per-weight work.

Per weight, one AND and one FMA. The GEMV is bound by ALU issue as much as by memory; this form took it from ~7
instructions per weight to 2.95-3.7 in SASS (scripts/sass_mix.py) and a Qwen3-8B layer from 58 to 41 us on the H200
(docs/performance.md). Nibble p of an int32 (of the int32 shifted right by 16 for p >= 4) is masked in place: bits 0..23
of an fp32 read as the integer times 2^-149 (subnormal, or normal with the smallest exponent: the same linear formula),
so the masked word *is* the float q * 16^(p % 4) * 2^-149, with no convert and no bias to subtract. x for plane p is
pre-multiplied by 2^(149 - 4 (p % 4) - 64) (exact), so each FMA adds q * x * 2^-64; the sums of x get the same 2^-64 and
the row sums are scaled back by 2^64 at the end: powers of two, so the result is the plain fp32 sum's. Range: |x| in
[2^-62, 2^43] (beyond 2^43 ~ 8.8e12 the scaled x overflows: no model's activations get there; below 2^-62 products go
subnormal and lose bits, which cannot move a 16-bit result). fp32 FMAs keep subnormals on the GPU (no flush-to-zero) and
in the interpreter.

Grid (cdiv(N, BLOCK_N),): a program owns BLOCK_N output rows and walks all of K in [BLOCK_N, BLOCK_KP] int32 tiles
(BLOCK_KP * 4 contiguous bytes per row: long coalesced runs, as the dense GEMV reads W [N, K]); occupancy (many
small programs per SM) keeps enough bytes in flight. No split-K, no workspace, one launch. Traffic: N*K/2 bytes of
weights + N*K/G*3 of scales and zeros + K*2 of x (from L2) -> the target time is N*K*(0.5 + 3/G) / HBM bandwidth.
GATED (packed gate_up [2I, K/8], gate rows first): a program also reads the up rows I + n and writes silu(g) * u
with g and u rounded to the activation dtype first, as the unfused GEMV + `silu_and_mul` do.

Two steps share this kernel: the fp32 planes above (`w4_gemv`), and with INT the integer step of
`kernels/w4_int_step.py` (`w4_gemv_int`: x rounded to int16 per 128-input chunk, dp2a against the nibbles, exact
int32 sums; ~2 instructions per weight), which batch-1 decode takes for the gated and long-row projections with 16-bit
activations; `w4_gemv_words` runs the integer step on words made beforehand by x's producer (`kernels/w4_words.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device, interpreting
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.tiles import epilogue
from orinfer.kernels.w4 import W4Weight
from orinfer.kernels.w4_int_step import _int_step, _x_plane_loads
from orinfer.kernels.w4_words import R as WORDS_R
from orinfer.kernels.w4_words import W4Words


# Powers of two of the plane arithmetic (module docstring): x for plane p is scaled by 2^(85 - 4 (p % 4)), the sums of
# x by 2^-64 like the products, and the row sums are scaled back by 2^64.
_X_SCALE_0 = tl.constexpr(2.0 ** 85)
_X_SCALE_1 = tl.constexpr(2.0 ** 81)
_X_SCALE_2 = tl.constexpr(2.0 ** 77)
_X_SCALE_3 = tl.constexpr(2.0 ** 73)
_DOWN = tl.constexpr(2.0 ** -64)
_UP = tl.constexpr(2.0 ** 64)


@triton.jit
def _nibble_plane(w, w_hi, P: tl.constexpr):
    """Nibble P of each int32 of `w` (`w_hi` = w >> 16; the masks keep bits 0..15 of it, so the shift's sign fill
    does not matter) as the fp32 subnormal q * 16^(P % 4) * 2^-149: the masked bits read as a float as they are
    (one AND, no convert, no bias to subtract)."""
    word = w if P < 4 else w_hi
    return (word & (15 << (4 * (P % 4)))).to(tl.float32, bitcast=True)


@triton.jit
def _x_planes(x_ptr, kbase, R: tl.constexpr, GPT: tl.constexpr, SUB: tl.constexpr):
    """x for the eight nibble planes of a tile's int32 columns (plane p: inputs kbase + p * R), each scaled by
    2^(149 - 4 (p % 4) - 64) so that times the plane's subnormal q * 16^(p % 4) * 2^-149 it gives q * x * 2^-64; and
    the per-group sums of x [GPT] times 2^-64 (for the zero points)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_plane_loads(x_ptr, kbase, R)
    xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    xg = tl.sum(tl.reshape(xs, (GPT, SUB)), axis=1) * _DOWN
    return ((x0 * _X_SCALE_0, x1 * _X_SCALE_1, x2 * _X_SCALE_2, x3 * _X_SCALE_3,
             x4 * _X_SCALE_0, x5 * _X_SCALE_1, x6 * _X_SCALE_2, x7 * _X_SCALE_3), xg)


@triton.jit
def _plane_dot(w, xps, BLOCK_N: tl.constexpr, GPT: tl.constexpr, SUB: tl.constexpr):
    """Per-group dots [BLOCK_N, GPT] (times 2^-64) of an int32 tile [BLOCK_N, GPT * SUB] with x (`_x_planes`)."""
    w_hi = w >> 16
    d = _nibble_plane(w, w_hi, 0) * xps[0][None, :]
    for p in tl.static_range(1, 8):
        d += _nibble_plane(w, w_hi, p) * xps[p][None, :]
    return tl.sum(tl.reshape(d, (BLOCK_N, GPT, SUB)), axis=2)


@triton.jit
def _load_step(acc_g, acc_u, w_g, w_u, c0, x_ptr, sc_ptr, zp_ptr, r_ld, cols, groups, stride_sg, UP,
               G8: tl.constexpr, R: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, GPT: tl.constexpr,
               SUB: tl.constexpr):
    """The accumulators plus one step: int32 columns c0 .. c0 + BLOCK_KP - 1 of the gate (and, GATED, up) rows, whose
    tiles `w_g`, `w_u` are loaded (`_load_tiles`); per group, s * (sum q x - z * sum x)."""
    c = c0 + cols
    xps, xg = _x_planes(x_ptr, (c // R) * (8 * R) + c % R, R, GPT, SUB)   # inputs of nibble 0 of each column c
    sg = r_ld[:, None] * stride_sg + (c0 // G8 + groups)[None, :]    # (GPT == 1: the one group of a sub-group tile)
    s = tl.load(sc_ptr + sg).to(tl.float32)
    z = tl.load(zp_ptr + sg).to(tl.float32)
    acc_g += s * (_plane_dot(w_g, xps, BLOCK_N, GPT, SUB) - z * xg[None, :])
    if GATED:
        s = tl.load(sc_ptr + sg + UP * stride_sg).to(tl.float32)
        z = tl.load(zp_ptr + sg + UP * stride_sg).to(tl.float32)
        acc_u += s * (_plane_dot(w_u, xps, BLOCK_N, GPT, SUB) - z * xg[None, :])
    return acc_g, acc_u


@triton.jit
def _load_tiles(wg_ptrs, c0, up_offset, GATED: tl.constexpr):
    """The gate (and, GATED, up) rows' int32 tiles at column c0 (without GATED the second is the first again)."""
    w_g = tl.load(wg_ptrs + c0, eviction_policy="evict_first")
    w_u = w_g
    if GATED:
        w_u = tl.load(wg_ptrs + up_offset + c0, eviction_policy="evict_first")
    return w_g, w_u


@triton.jit
def _step(acc_g, acc_u, w_g, w_u, c0, x_ptr, meta_ptr, K8, C, sc_ptr, zp_ptr, r_ld, cols, groups, stride_sg, UP,
          G8: tl.constexpr, R: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
          GPT: tl.constexpr, SUB: tl.constexpr, INT: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    """One tile of the row, its weights loaded: the fp32 planes (`_load_step`: GPT groups of SUB int32), or INT the
    integer dot products (`w4_int_step._int_step`: GPT chunks of R int32; WORDS: x's words made beforehand)."""
    if INT:
        return _int_step(acc_g, acc_u, w_g, w_u, c0, x_ptr, meta_ptr, K8, C, sc_ptr, zp_ptr, r_ld, cols, groups,
                         stride_sg, UP, G8, R, GATED, BLOCK_N, BLOCK_KP, WORDS, ASM)
    return _load_step(acc_g, acc_u, w_g, w_u, c0, x_ptr, sc_ptr, zp_ptr, r_ld, cols, groups, stride_sg, UP,
                      G8, R, GATED, BLOCK_N, GPT, SUB)


@triton.jit
def _w4_gemv_kernel(x_ptr, qw_ptr, sc_ptr, zp_ptr, b_ptr, out_ptr, N_OUT, K8, stride_qw, stride_sg, UP, meta_ptr, C,
                    eps, G8: tl.constexpr, R: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                    CLAMP16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, GPT: tl.constexpr,
                    SUB: tl.constexpr, STEPS: tl.constexpr, INT: tl.constexpr, WORDS: tl.constexpr,
                    RMS: tl.constexpr, C_P2: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                    PRELOAD: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ld = tl.minimum(rows, N_OUT - 1).to(tl.int64)               # tail rows: computed twice, never stored
    cols = tl.arange(0, BLOCK_KP)
    groups = tl.arange(0, GPT)
    wg_ptrs = qw_ptr + r_ld[:, None] * stride_qw + cols[None, :]
    acc_g = tl.zeros([BLOCK_N, GPT], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, GPT], dtype=tl.float32)
    up_offset = UP * stride_qw
    if PRELOAD:
        # The weights are constants, so the first tiles may load before the PDL wait: the programs of a GEMV launched
        # under a short kernel (a norm, the split combine) fetch their weights while it runs, instead of idling.
        w_g, w_u = _load_tiles(wg_ptrs, 0, up_offset, GATED)
    if PDL:
        gdc_wait()
    if RMS:  # words of an RMSNorm's h * w (`w4_words.rms_norm_words`): its per-chunk sums of h^2, loaded early
        sq_chunks = tl.arange(0, C_P2)
        sq = tl.load(meta_ptr + 2 * C + sq_chunks, mask=sq_chunks < C, other=0.0)
    if STEPS:
        # A few steps (Qwen's K = 4096 is one, 12288 three): straight-line code. As a loop, the compiler pipelines
        # the weight tiles through shared memory, which measured slower in the engine (2.24 vs 2.14 ms per batch-1
        # step). PRELOAD also issues each step's loads before the step ahead of it is computed.
        for i in tl.static_range(STEPS):
            if not PRELOAD:
                w_g, w_u = _load_tiles(wg_ptrs, i * BLOCK_KP, up_offset, GATED)
            elif i + 1 < STEPS:
                next_g, next_u = _load_tiles(wg_ptrs, (i + 1) * BLOCK_KP, up_offset, GATED)
            acc_g, acc_u = _step(acc_g, acc_u, w_g, w_u, i * BLOCK_KP, x_ptr, meta_ptr, K8, C, sc_ptr, zp_ptr,
                                 r_ld, cols, groups, stride_sg, UP, G8, R, GATED, BLOCK_N, BLOCK_KP, GPT, SUB, INT,
                                 WORDS, ASM)
            if PRELOAD and i + 1 < STEPS:
                w_g, w_u = next_g, next_u
    else:
        for c0 in range(0, K8, BLOCK_KP):
            w_g, w_u = _load_tiles(wg_ptrs, c0, up_offset, GATED)
            acc_g, acc_u = _step(acc_g, acc_u, w_g, w_u, c0, x_ptr, meta_ptr, K8, C, sc_ptr, zp_ptr, r_ld, cols,
                                 groups, stride_sg, UP, G8, R, GATED, BLOCK_N, BLOCK_KP, GPT, SUB, INT, WORDS, ASM)
    if PDL:
        gdc_launch_dependents()
    back = 1.0 if INT else _UP                                      # back from the planes' scale
    g = tl.sum(acc_g, axis=1) * back
    u = tl.sum(acc_u, axis=1) * back
    if RMS:  # the norm's 1 / sqrt(mean(h^2) + eps), as `kernels/norm.py` computes it
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / (K8 * 8) + eps)
        g *= rstd
        u *= rstd
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + r_ld).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows, epilogue(g, u, bias, out_ty, HAS_BIAS, GATED, CLAMP16), mask=rows < N_OUT)


UNROLL_STEPS = 4   # rows of up to this many steps are straight-line code (the kernel's STEPS; 0: a runtime loop)


class W4GemvConfig(NamedTuple):
    block_n: int     # output rows per program
    block_kp: int    # int32 per row per step (8 * block_kp inputs)
    num_warps: int
    # Rows of up to UNROLL_STEPS steps: the first tiles load before the PDL wait, and each next step's before the
    # step ahead of it is computed. The tiles then stay in registers longer (Qwen3-8B qkv: 112 -> 168 per thread,
    # gated: 80 -> 128, sm_90 SASS), so it pays only where fewer programs per SM still keep enough loads in flight:
    # on down, not on qkv/o or gate_up (INT_LONG_ROWS).
    preload: bool = False


# Chosen in the engine's batch-1 AWQ decode step on the H200 (docs/performance.md lists where each tile's figures come
# from): 2.08 ms per step against 2.12 for (8, 512, 4), 2.20 for (4, 512, 4), 2.66 for (32, 512, 4), which runs out
# of registers.
# More rows per program spread each thread's x work over more weights (2.95-3.2 SASS instructions per weight).
DEFAULT_GEMV = W4GemvConfig(16, 512, 4)
# Rows longer than one step (Qwen3-8B's down: K = 12288, three steps) do better with half the rows per program: twice
# the programs keep more loads in flight while each walks its steps (step 2.033 against 2.077 ms; 4 rows: 2.127).
DEFAULT_GEMV_LONG_ROWS = W4GemvConfig(8, 512, 4)
# The integer step's tiles, chosen in the batch-1 AWQ step from the Qwen3-8B shapes' best: gate_up (8, 512, 4) 15.4 us
# (16 rows: 16.5). down (8, 512, 4) with preload: the step (a fresh engine per variant) 1.910 ms against
# 2.056 for the earlier tile, (4, 512, 4), without; 1.952 for (4, 512, 4) with, 1.962 for (8, 512, 4) without;
# preloading gate_up or qkv/o as well: 1.960 and 1.966.
INT_GATED = W4GemvConfig(8, 512, 4)
INT_LONG_ROWS = W4GemvConfig(8, 512, 4, preload=True)
# With x's words made beforehand (`w4_gemv_words`): the best tiles on the Qwen3-8B shapes, in isolation (qkv 4.9 us,
# o 3.7, gate_up 14.0).
WORDS_SHORT = W4GemvConfig(8, 512, 4)
WORDS_GATED = W4GemvConfig(4, 512, 4)
GEMV_CONFIGS = [W4GemvConfig(bn, kp, w) for bn, kp, w in
                [(1, 512, 2), (2, 512, 2), (2, 256, 2), (4, 256, 4), (4, 512, 4), (2, 1024, 4), (8, 128, 4),
                 (4, 128, 2), (8, 256, 4), (1, 1024, 4), (2, 512, 4), (16, 128, 4)]]


def _tile_groups(k8: int, g8: int, r: int, block_kp: int) -> tuple[int, int, int]:
    """(int32 per row per step, groups per tile, int32 per group-slice): the largest power of two <= block_kp that
    divides K/8 and either holds whole groups or divides one (every tile then sees whole chunks of R int32)."""
    kp = 1 << (block_kp.bit_length() - 1)
    while kp > r and (k8 % kp or (kp % g8 if kp > g8 else g8 % kp)):
        kp //= 2
    if k8 % kp or (kp % g8 if kp > g8 else g8 % kp) or kp % r:
        raise ValueError(f"no W4 GEMV tile fits K={8 * k8} with group size {8 * g8}")
    return (kp, kp // g8, g8) if kp >= g8 else (kp, 1, kp)


def w4_gemv(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None, gated: bool = False,
            cfg: W4GemvConfig | None = None) -> torch.Tensor:
    """One row: x [..., K] (one row in all) -> [..., N] (gated: [..., N/2] = silu(gate) * up) in x's dtype."""
    cfg = cfg or (DEFAULT_GEMV if w.in_features // 8 <= DEFAULT_GEMV.block_kp else DEFAULT_GEMV_LONG_ROWS)
    return _launch(x, w, bias, gated, cfg, integer=False)


def w4_gemv_int(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None = None, gated: bool = False,
                cfg: W4GemvConfig | None = None) -> torch.Tensor:
    """`w4_gemv` with the integer step (`kernels/w4_int_step.py`: x rounded to int16 per chunk, dp2a): bf16/fp16 x."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"w4_gemv_int takes bf16 or fp16 activations, got {x.dtype}")
    return _launch(x, w, bias, gated, cfg or (INT_GATED if gated else INT_LONG_ROWS), integer=True)


def w4_gemv_words(xw: W4Words, w: W4Weight, bias: torch.Tensor | None = None, gated: bool = False,
                  cfg: W4GemvConfig | None = None) -> torch.Tensor:
    """`w4_gemv_int` on x's words made by x's producer (`kernels/w4_words.py`); with an RMSNorm's words (xw.eps set)
    the sums are multiplied by the norm's 1 / rms before the bias or SwiGLU."""
    if xw.in_features != w.in_features or w.chunk_int32 != WORDS_R:
        raise ValueError(f"words of {xw.in_features} inputs do not fit a W4 weight of {w.in_features} inputs and "
                         f"group size {w.group_size}")
    return _launch(xw, w, bias, gated, cfg or (WORDS_GATED if gated else WORDS_SHORT), integer=True)


def _launch(x: torch.Tensor | W4Words, w: W4Weight, bias: torch.Tensor | None, gated: bool, cfg: W4GemvConfig,
            integer: bool) -> torch.Tensor:
    words = x if isinstance(x, W4Words) else None
    k, n = w.in_features, w.out_features
    if words is None:
        check_device(x)
        if x.shape[-1] != k or x.numel() != k:
            raise ValueError(f"w4_gemv takes one row of {k} inputs, got x {tuple(x.shape)}")
        x1, meta, dtype, shape = x.reshape(k).contiguous(), None, x.dtype, tuple(x.shape)
    else:
        x1, meta, dtype, shape = words.words, words.meta, words.dtype, words.shape
    n_out = n // 2 if gated else n
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n_out} outputs")
    g8, r = w.group_size // 8, w.chunk_int32
    block_kp, gpt, sub = _tile_groups(k // 8, g8, r, cfg.block_kp)
    if integer:   # per chunk of R int32 rather than per group
        gpt, sub = block_kp // r, r
    out = torch.empty(n_out, dtype=dtype, device=x1.device)
    pdl = use_pdl(x1)
    steps = k // 8 // block_kp
    grid = triton.cdiv(n_out, cfg.block_n)
    rms = words is not None and words.eps is not None
    _w4_gemv_kernel[(grid,)](
        x1, w.packed, w.scales, w.zeros, bias if bias is not None else out, out, n_out, k // 8,
        w.packed.stride(0), w.scales.stride(0), n_out if gated else 0, x1 if meta is None else meta, k // (8 * r),
        words.eps if rms else 0.0, G8=g8, R=r, HAS_BIAS=bias is not None, GATED=gated, CLAMP16=dtype == torch.float16,
        BLOCK_N=cfg.block_n, BLOCK_KP=block_kp, GPT=gpt, SUB=sub,
        STEPS=steps if steps <= UNROLL_STEPS else 0, INT=integer, WORDS=words is not None, RMS=rms,
        C_P2=triton.next_power_of_2(k // (8 * r)), ASM=not interpreting(), PDL=pdl,
        PRELOAD=cfg.preload and steps <= UNROLL_STEPS, num_warps=cfg.num_warps, launch_pdl=pdl)
    return out.reshape(*shape[:-1], n_out)


def compile_sm90(block_n: int, block_kp: int, num_warps: int, gated: bool = False, k8: int = 512,
                 integer: bool = False, preload: bool = False, words: bool = False, rms: bool = False
                 ) -> triton.compiler.CompiledKernel:
    """The kernel compiled ahead of time for sm_90, bf16 x (words: its words made beforehand, rms: an RMSNorm's),
    group size 128, K = 8 * k8 (Qwen3-8B: 512; down: 1536),
    with the launcher's specialisations (pointers and ints divisible by 16). Needs no GPU: Triton ships ptxas. For
    reading its code without a device (scripts/sass_mix.py, tests/test_w4_codegen.py); returns Triton's compiled
    kernel (`.asm["ptx"]`, `.asm["cubin"]`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    args = {"x_ptr": "*i32" if words else "*bf16", "qw_ptr": "*i32", "sc_ptr": "*fp16", "zp_ptr": "*u8",
            "b_ptr": "*bf16", "out_ptr": "*bf16", "N_OUT": "i32", "K8": "i32", "stride_qw": "i32",
            "stride_sg": "i32", "UP": "i32", "meta_ptr": "*fp32", "C": "i32"}
    steps = k8 // block_kp
    consts = dict(G8=16, R=16, HAS_BIAS=False, GATED=gated, CLAMP16=False, BLOCK_N=block_n, BLOCK_KP=block_kp,
                  GPT=block_kp // 16, SUB=16, STEPS=steps if steps <= UNROLL_STEPS else 0, INT=integer or words,
                  WORDS=words, RMS=rms, C_P2=triton.next_power_of_2(k8 // 16), ASM=True, PDL=True,
                  PRELOAD=preload and steps <= UNROLL_STEPS)
    attrs = {(_w4_gemv_kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in args}
    args["eps"] = "fp32"
    signature = args | {name: "constexpr" for name in consts}
    return triton.compile(ASTSource(fn=_w4_gemv_kernel, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
