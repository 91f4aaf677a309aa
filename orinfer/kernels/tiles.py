"""Triton helpers shared by the quantized matmul kernels (W4, FP8, W8): the grouped order of output tiles, the epilogue
that turns fp32 sums into stored values (bias, fused SwiGLU with the unfused path's roundings, fp16 clamp), and the
conversion of 8-bit weight codes (e4m3, or uint8 with a zero point) to fp32, and of 16-bit float weights (no scales:
the one-row GEMV helpers of `kernels/fp8_gemv.py` read those too, for `kernels/moe_gemv16.py`)."""

from __future__ import annotations

import os

import triton
import triton.language as tl


E4M3, UINT8 = tl.constexpr(0), tl.constexpr(1)      # the 8-bit code types (`code_values`' CODES)
FLOAT16 = tl.constexpr(2)        # 16-bit float weights (bf16 or fp16: the values themselves, no scales, no zeros)
_TWO_23 = tl.constexpr(8388608.0)


def _u8_to_f32_asm(pack: int) -> str:
    """PTX: `pack` uint8 codes (the low bytes of $pack) -> the fp32 bits of 2^23 + code in $0..$pack-1. prmt builds
    each word from byte i of the input (selector nibble i), two zero bytes and 0x4B (bytes 4 and 7 of c): one
    instruction per weight, where the compiler's own byte extraction and or take two."""
    return "\n".join(["{", ".reg .b32 c;", "mov.b32 c, 0x4B000000;",
                      *(f"prmt.b32 ${i}, ${pack}, c, 0x{0x7440 + i:x};" for i in range(pack)), "}"])


_U8_TO_F32_2 = tl.constexpr(_u8_to_f32_asm(2))
_U8_TO_F32_4 = tl.constexpr(_u8_to_f32_asm(4))
# The CPU interpreter runs no PTX (nor libdevice): kernels take plain Triton forms of the same operations there.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def code_args(zeros: object) -> dict[str, int]:
    """A kernel's CODES and ZERO arguments for `zeros`: None: e4m3 codes; a tensor: uint8 codes with a zero point per
    (row, group) read from it (ZERO = -1); an int: uint8 codes whose zero points all equal it (symmetric GPTQ's 128:
    no zero-point traffic)."""
    if zeros is None:
        return {"CODES": E4M3.value, "ZERO": -1}
    return {"CODES": UINT8.value, "ZERO": zeros if isinstance(zeros, int) else -1}


@triton.jit
def zero_offsets(z_ptrs, mask, ZERO: tl.constexpr):
    """The `code_values` offsets 2^23 + z of uint8 codes' zero points z (exact in fp32): the constant of a uniform
    zero point ZERO >= 0, or the fp16 / fp32 values at z_ptrs (where `mask`; None: everywhere)."""
    if ZERO >= 0:
        return _TWO_23 + ZERO
    elif mask is None:
        return tl.load(z_ptrs).to(tl.float32) + _TWO_23
    else:
        return tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32) + _TWO_23


@triton.jit
def code_values(w, zoff, CODES: tl.constexpr, PACK: tl.constexpr = 4):
    """8-bit weight codes w as fp32, before their scale. CODES == E4M3 (or FLOAT16, 16-bit weights): the values
    (zoff unused).
    CODES == UINT8: code - zero, exact, for zoff = 2^23 + zero (`zero_offsets`) broadcastable to w: the byte or-ed
    into the low mantissa bits of 2^23 reads as 2^23 + code, and one subtraction leaves code - zero (no integer ->
    float convert, which runs at a quarter of the FMA rate on sm_90). PACK (2 or 4): codes per PTX instance, as many
    as a thread holds contiguous in w's layout (16-byte loads: 4; an MMA operand of kWidth 2: 2), so that no bytes
    are shuffled into place first."""
    if CODES != UINT8:
        return w.to(tl.float32)
    elif INTERPRETED:
        return (w.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - zoff
    elif PACK == 2:
        return tl.inline_asm_elementwise(_U8_TO_F32_2, "=r,=r,r", [w], dtype=tl.float32, is_pure=True,
                                         pack=2) - zoff
    else:
        return tl.inline_asm_elementwise(_U8_TO_F32_4, "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True,
                                         pack=4) - zoff


@triton.jit
def round_to(v, out_ty: tl.constexpr, CLAMP16: tl.constexpr):
    """v rounded to out_ty; fp16 clamped to +-65504 first (Qwen's activations can overflow fp16)."""
    if CLAMP16:
        v = tl.minimum(tl.maximum(v, -65504.0), 65504.0)
    return v.to(out_ty)


@triton.jit
def epilogue(g, u, bias, out_ty: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, CLAMP16: tl.constexpr):
    """fp32 sums -> stored values: + bias, or SwiGLU with the unfused path's roundings (g, u and silu(g) rounded to
    the activation dtype, as GEMM + `silu_and_mul` do); fp16 clamped to +-65504."""
    if HAS_BIAS:
        g += bias
    if GATED:
        g = round_to(g, out_ty, CLAMP16).to(tl.float32)
        u = round_to(u, out_ty, CLAMP16).to(tl.float32)
        s = round_to(g / (1.0 + tl.exp(-g)), out_ty, CLAMP16).to(tl.float32)
        g = s * u
    return round_to(g, out_ty, CLAMP16)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of program `pid`: programs walk bands of GROUP_M tile rows column by column, so that
    programs running together share the same column's tiles of the second operand in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    band = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // band) * GROUP_M
    band_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % band) % band_m, (pid % band) // band_m


@triton.jit
def tile_rows(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(offs_m, offs_n, rm, rn) of tile (pid_m, pid_n): its row and column indices, and the same clamped to M - 1 /
    N - 1 (rows past the end re-read the last one, so loads need no masks; they are not stored)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, tl.minimum(offs_m, M - 1), tl.minimum(offs_n, N - 1)


@triton.jit
def store_tile(out_ptr, g, u, b_ptr, rn, offs_m, offs_n, mask, stride_om, HAS_BIAS: tl.constexpr,
               GATED: tl.constexpr, CLAMP16: tl.constexpr):
    """Stores `epilogue(g, u, bias[rn])` of a [BLOCK_M, BLOCK_N] tile at out[offs_m, offs_n] (where `mask`)."""
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             epilogue(g, u, bias, out_ty, HAS_BIAS, GATED, CLAMP16), mask=mask)
