"""The integer step of the one-row INT4 GEMV (`w4_gemv.w4_gemv_int`): x rounded to int16 per chunk and multiplied by
the nibbles with `dp2a`. Batch-1 decode uses it for the gate/up + SwiGLU and long-row (down) projections with
bf16/fp16 activations (`takes`).

Why: `w4_gemv`'s fp32 step costs ~3 SASS instructions per weight, most of them on the half-rate ALU pipe, so its
issue time is ~70% of its memory time and the two overlap poorly. `dp2a` multiplies two int16 by two bytes and adds
both products to an int32 in one instruction: an int32 of eight nibbles costs two ANDs, one shift and four dp2a
(1.97 SASS instructions per weight for the gated tile, x work and reductions included). Qwen3-8B gate_up: 15.4 us
against 18.1; the batch-1 AWQ step 1.92 against 2.04 ms (H200; docs/performance.md).

Math, per chunk of 8R inputs (R int32 of a row; 128 inputs at AWQ's group 128, one group or a part of one): x is
scaled by the power of two f = 2^(14 - e), e = floor(log2(max |x| over the chunk)), and rounded to int16
v = round(x f), |v| < 2^15. Then exactly, in int32,
    acc[n] = sum_k q[n, k] v[k]                      |acc| <= 8R * 15 * 2^15 < 2^26
and in fp32 y[n] += s[n, g] / f * (acc[n] - z[n, g] * sum_k v[k]) (+ b[n]), rounded once to x's dtype (fp16 clamped
to +-65504). The weight side is exact; the only rounding beyond fp32's is x's to 16 bits per chunk: each input is
within 2^-16 of the chunk's largest |x| of its value (a bf16 input within 2^7 of that largest value, an fp16 one
within 2^4, is exact). An input that is inf or nan makes its chunk's outputs nan, as fp32 arithmetic would; a chunk
whose largest |x| is below 2^-112 keeps fewer bits. (llama.cpp's batch-1 kernels round x to int8 per 32 inputs; this
keeps 8 more bits per chunk.)

Word layout: nibble p of an int32 column c holds input k(c, p) = (c // R) 8R + c % R + p R (`kernels.w4`).
dp2a.lo reads bytes 0 and 1 of its byte operand, .hi bytes 2 and 3; (w & 0x0F0F0F0F) holds nibbles 0, 2, 4, 6 in its
bytes, (w >> 4) & 0x0F0F0F0F nibbles 1, 3, 5, 7; so x's int16 pairs per column are (v0, v2), (v4, v6), (v1, v3),
(v5, v7).

The kernel (`w4_gemv._w4_gemv_kernel` with INT) is `w4_gemv`'s: grid, tiles and straight-line steps are the same,
and each program makes x's words for its tile's columns itself (x is 8-24 KB, read from L2). The CPU interpreter runs
no PTX: there (ASM off) the same words go through integer arithmetic that does what dp2a and prmt do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.w4 import W4Weight

_MAGIC = tl.constexpr(12582912.0)        # 1.5 * 2^23: y + MAGIC rounds y (|y| < 2^22) to an integer in the low bits
_MAGIC_BITS = tl.constexpr(0x4B400000)   # its bit pattern; the low 16 bits of (y + MAGIC)'s bits are round(y)'s


@triton.jit
def _pair16(lo, hi, ASM: tl.constexpr):
    """Low 16 bits of `lo` | low 16 bits of `hi` << 16 (one PRMT)."""
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [lo, hi], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return (lo & 0xFFFF) | (hi << 16)


@triton.jit
def _dp2a(a, b, c, HI: tl.constexpr):
    """dp2a.{lo,hi}.s32.u32 in integer arithmetic (the interpreter's path): c + a.h0 * b.byte(j) + a.h1 * b.byte(j+1),
    j = 2 for HI else 0, with a's halves signed and b's bytes unsigned."""
    sh: tl.constexpr = 16 if HI else 0
    return c + ((a << 16) >> 16) * ((b >> sh) & 0xFF) + (a >> 16) * ((b >> (sh + 8)) & 0xFF)


@triton.jit
def _dot8(w, x02, x46, x13, x57, acc, ASM: tl.constexpr):
    """acc + sum_p nibble_p(w) * v_p over the eight nibbles of each int32 `w` (2 AND, 1 shift, 4 dp2a)."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{ .reg .b32 e, o;
            and.b32 e, $1, 0x0F0F0F0F;
            shr.u32 o, $1, 4;
            and.b32 o, o, 0x0F0F0F0F;
            dp2a.lo.s32.u32 $0, $2, e, $6;
            dp2a.hi.s32.u32 $0, $3, e, $0;
            dp2a.lo.s32.u32 $0, $4, o, $0;
            dp2a.hi.s32.u32 $0, $5, o, $0; }""",
            "=r,r,r,r,r,r,r", [w, x02, x46, x13, x57, acc], dtype=tl.int32, is_pure=True, pack=1)
    e = w & 0x0F0F0F0F
    o = (w >> 4) & 0x0F0F0F0F
    return _dp2a(x57, o, _dp2a(x13, o, _dp2a(x46, e, _dp2a(x02, e, acc, False), True), False), True)


@triton.jit
def _to_int(x, f):
    """round(x f) as an int32 (|x f| < 2^15): the fp32 add of 1.5 * 2^23 rounds to nearest even into the low bits."""
    return (x * f + _MAGIC).to(tl.int32, bitcast=True) - _MAGIC_BITS


@triton.jit
def _x_plane_loads(x_ptr, kbase, R: tl.constexpr):
    """x for the eight nibble planes of a tile's int32 columns (plane p: inputs kbase + p R), in fp32 (both steps)."""
    return (tl.load(x_ptr + kbase).to(tl.float32), tl.load(x_ptr + kbase + R).to(tl.float32),
            tl.load(x_ptr + kbase + 2 * R).to(tl.float32), tl.load(x_ptr + kbase + 3 * R).to(tl.float32),
            tl.load(x_ptr + kbase + 4 * R).to(tl.float32), tl.load(x_ptr + kbase + 5 * R).to(tl.float32),
            tl.load(x_ptr + kbase + 6 * R).to(tl.float32), tl.load(x_ptr + kbase + 7 * R).to(tl.float32))


@triton.jit
def _x_words(x_ptr, kbase, R: tl.constexpr, CHUNKS: tl.constexpr, ASM: tl.constexpr):
    """x for a tile's int32 columns (input kbase + p R for nibble p of column c): `_words_of` its eight planes."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_plane_loads(x_ptr, kbase, R)
    return _words_of(x0, x1, x2, x3, x4, x5, x6, x7, R, CHUNKS, ASM)


@triton.jit
def _words_of(x0, x1, x2, x3, x4, x5, x6, x7, R: tl.constexpr, CHUNKS: tl.constexpr, ASM: tl.constexpr):
    """The eight fp32 planes of CHUNKS chunks of R int32 columns (x_p[c]: the input of nibble p of column c) as the
    four int16-pair words per column, and per chunk the scale back 1/f, the sum of v, and a nan guard (0, or nan
    for a non-finite x)."""
    m = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                   tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    amax = tl.max(tl.reshape(m, (CHUNKS, R)), axis=1)
    # biased exponent of amax (amax >= 0: no sign bit), kept where 2^(14 - e) and 2^(e - 14) are normal floats
    e = tl.minimum(tl.maximum(amax.to(tl.int32, bitcast=True) >> 23, 15), 254)
    f = ((268 - e) << 23).to(tl.float32, bitcast=True)                 # 2^(14 - (e - 127))
    inv_f = ((e - 14) << 23).to(tl.float32, bitcast=True)
    f_col = tl.reshape(tl.broadcast_to(f[:, None], (CHUNKS, R)), (CHUNKS * R,))
    v0 = _to_int(x0, f_col)
    v1 = _to_int(x1, f_col)
    v2 = _to_int(x2, f_col)
    v3 = _to_int(x3, f_col)
    v4 = _to_int(x4, f_col)
    v5 = _to_int(x5, f_col)
    v6 = _to_int(x6, f_col)
    v7 = _to_int(x7, f_col)
    v_sum = tl.sum(tl.reshape(((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), (CHUNKS, R)), axis=1)
    return (_pair16(v0, v2, ASM), _pair16(v4, v6, ASM), _pair16(v1, v3, ASM), _pair16(v5, v7, ASM),
            inv_f, v_sum.to(tl.float32), amax - amax)


@triton.jit
def _loaded_words(words_ptr, meta_ptr, K8, C, c, ch):
    """`_words_of`'s results made beforehand: the words of int32 columns `c` and the 1/f (nan for a non-finite chunk:
    the guard is folded in) and sum of v of chunks `ch`."""
    inv_f = tl.load(meta_ptr + ch)
    return (tl.load(words_ptr + c), tl.load(words_ptr + K8 + c), tl.load(words_ptr + 2 * K8 + c),
            tl.load(words_ptr + 3 * K8 + c), inv_f, tl.load(meta_ptr + C + ch), tl.zeros_like(inv_f))


@triton.jit
def _half(word, H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr):
    """The even (H = 0) or odd (H = 1) columns of a word vector, broadcast over the tile's rows."""
    even, odd = tl.split(tl.reshape(word, (BLOCK_KP // 2, 2)))
    return tl.broadcast_to((odd if H else even)[None, :], (BLOCK_N, BLOCK_KP // 2))


@triton.jit
def _rows_step(acc, w, xw, sc_ptr, zp_ptr, sg, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, R: tl.constexpr,
               ASM: tl.constexpr):
    """acc [BLOCK_N, CHUNKS] + one loaded int32 tile's s / f * (sum q v - z sum v) per row and chunk."""
    s = tl.load(sc_ptr + sg).to(tl.float32)
    z = tl.load(zp_ptr + sg).to(tl.float32)
    # A thread's two adjacent columns share one dp2a chain: half the adds of the per-chunk reduction.
    w_even, w_odd = tl.split(tl.reshape(w, (BLOCK_N, BLOCK_KP // 2, 2)))
    d = tl.zeros([BLOCK_N, BLOCK_KP // 2], dtype=tl.int32)
    d = _dot8(w_even, _half(xw[0], 0, BLOCK_N, BLOCK_KP), _half(xw[1], 0, BLOCK_N, BLOCK_KP),
              _half(xw[2], 0, BLOCK_N, BLOCK_KP), _half(xw[3], 0, BLOCK_N, BLOCK_KP), d, ASM)
    d = _dot8(w_odd, _half(xw[0], 1, BLOCK_N, BLOCK_KP), _half(xw[1], 1, BLOCK_N, BLOCK_KP),
              _half(xw[2], 1, BLOCK_N, BLOCK_KP), _half(xw[3], 1, BLOCK_N, BLOCK_KP), d, ASM)
    dq = tl.sum(tl.reshape(d, (BLOCK_N, BLOCK_KP // R, R // 2)), axis=2).to(tl.float32)
    return acc + (s * xw[4][None, :]) * (dq - z * xw[5][None, :]) + xw[6][None, :]


@triton.jit
def _int_step(acc_g, acc_u, w_g, w_u, c0, x_ptr, meta_ptr, K8, C, sc_ptr, zp_ptr, r_ld, cols, chunks, stride_sg,
              UP, G8: tl.constexpr, R: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_KP: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    """The accumulators plus int32 columns c0 .. c0 + BLOCK_KP - 1 of the gate (and, GATED, up) rows, whose tiles
    `w_g`, `w_u` are loaded. x is made into words here, or WORDS: x_ptr holds them ([4, K8] int32) and meta_ptr
    their per-chunk 1/f and sum of v ([2, C] fp32 at least)."""
    c = c0 + cols
    if WORDS:   # made beforehand (`kernels/w4_words.py`)
        xw = _loaded_words(x_ptr, meta_ptr, K8, C, c, c0 // R + chunks)
    else:
        xw = _x_words(x_ptr, (c // R) * (8 * R) + c % R, R, BLOCK_KP // R, ASM)
    sg = r_ld[:, None] * stride_sg + ((c0 + chunks * R) // G8)[None, :]
    acc_g = _rows_step(acc_g, w_g, xw, sc_ptr, zp_ptr, sg, BLOCK_N, BLOCK_KP, R, ASM)
    if GATED:
        acc_u = _rows_step(acc_u, w_u, xw, sc_ptr + UP * stride_sg, zp_ptr + UP * stride_sg, sg, BLOCK_N, BLOCK_KP,
                           R, ASM)
    return acc_g, acc_u


def takes(x: torch.Tensor, w: W4Weight, gated: bool) -> bool:
    """Whether batch-1 decode uses the integer step (`w4_gemv.w4_gemv_int`): 16-bit x, and the gated or long-row
    (K > 4096) projections. For Qwen3-8B's qkv and o (K = 4096) it is no faster than `w4_gemv` alone and slower in the
    step (every projection 1.963 ms, against 1.932 with gate_up and down only), and fp32 x keeps
    `w4_gemv`'s fp32-exact products."""
    return x.dtype in (torch.bfloat16, torch.float16) and (gated or w.in_features > 4096)
