"""FP8 block-wise W8A16 matmul on tensor cores for decode batches (2..~64 rows of x): the weight read once per
BLOCK_M rows of x and dequantised in registers, x in 16 bits, split-K so that a few output tiles still fill the chip.

Math: y [M, N] = x [M, K] W^T (+ b), W = q * s per [bn, bk] block (`kernels/fp8_block.py`), fp32 accumulation, result
rounded once to x's dtype (fp16 clamped to +-65504); up to summation order it is the fp32 sum of q * s * x (the weight
is not rounded to x's dtype, as `fp8_block_linear_ref` rounds it). Swap-AB: the weight tile [BLOCK_N, BLOCK_K] is the
MMA's M side (64 rows per warpgroup on Hopper's wgmma, the unpacked tile fed from registers) and x^T [BLOCK_K, BLOCK_M]
its N side, so a batch of a few rows still fills the MMA (BLOCK_M >= 16; rows past M repeat row M - 1 and are not
stored). BLOCK_K divides bk, so a K step sees one scale per weight row:

    acc[n, m] += s[n, k / bk] * dot(q_tile, x_tile^T)

The weight tile as an MMA operand (MODE, a constexpr):
  A16_BF16  bf16 x: `_E4M3_TO_BF16` moves bits (2 integer instructions per weight; Hopper has no e4m3 -> bf16 convert,
            and e4m3 -> f16 -> f32 -> bf16 takes 2 converts per weight on a 16/clk/SM pipe: slower than the read rate)
            giving the bf16 *bits* of q * 2^-120, exact, subnormals included. x is scaled by 2^64 (exact, HMUL2) so
            that products stay normal fp32 whatever the tensor cores do with subnormals; s carries 2^56 back.
  A16_FP16  fp16 x: q -> fp16 is one cvt per two weights, exact.
  PLAIN     fp32 x, and the CPU interpreter (which runs no PTX): fp32 operands, exact fp32 dots.
SASS per weight (sm_90, compiled on the CPU: tests/test_fp8_codegen.py): about 4.2 instructions for bf16 x
(the unpack, 2-byte shared loads of the wgmma A fragment), 2.7 for fp16 x.

Grid (tiles, SPLIT), tiles of [BLOCK_M x rows, BLOCK_N weight rows]; SPLIT > 1 splits K (`kernels/splitk.py`: the last
program of a tile sums the partials in a fixed order; one launch, CUDA-graph safe). GATED (packed gate_up [2I, K]): a
program multiplies the gate rows n and the up rows I + n and stores silu(g) * u with the unfused path's roundings.
Traffic: N*K bytes of weight per BLOCK_M rows of x + M*K*2 of x per BLOCK_N weight rows (L2) + M*N*2 out +
SPLIT*M*N*4 of partials (L2): bound by the weight read, the target is N*K / HBM bandwidth, half the bf16 GEMM's bytes.
More rows (prefill): `kernels/fp8_gemm.py` (W8A8 on FP8 tensor cores).

8-bit integer codes (W8, `kernels/w8.py`; CODES = UINT8, as in `kernels/fp8_gemv.py`): uint8 weight, fp16 scales and
zero points per (row, group) (or one for all), bn = 1, bk = the group size. The operand is q - z, formed exactly in fp32
(`tiles.code_values`) and converted to x's 16-bit type, exact (integers of at most 9 bits): no 2^64 trick.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.fp8_gemv import _scale_rows, check_fp8_weight
from orinfer.kernels.gemv import as_rows, check_device, cuda_sm_count, interpreting
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.splitk import counters, plan, splitk_store
from orinfer.kernels.tiles import (E4M3, UINT8, code_args, code_values, grouped_tile, tile_rows,
                                   zero_offsets)

A16_BF16, A16_FP16, PLAIN = 0, 1, 2


def _e4m3_to_bf16_asm() -> str:
    """PTX: four e4m3 bytes of $2 -> the bf16 bits of q * 2^-120 in $0 (bytes 0, 1) and $1 (bytes 2, 3). Per output
    word: prmt puts bytes b, b' at bits 0..7 and 16..23 (u); v = u << 4 moves the 7 magnitude bits (exponent,
    mantissa) to bf16's bits 4..10 of each half: with bf16's exponent bias of 127 against e4m3's 7 that reads as
    q * 2^-120, for subnormal e4m3 (exponent 0) too since bf16's own subnormals scale the same way; the sign, at bit
    11 now, moves to bit 15 by adding s * (2^15 - 2^11), s = u & 0x00800080 (no carry between the halves).
    Two weights per prmt, and, shl, mad: 2 integer instructions per weight."""
    return "\n".join(["{", ".reg .b32 u, s, v;", "prmt.b32 u, $1, 0, 0x4140;", "and.b32 s, u, 0x00800080;",
                      "shl.b32 v, u, 4;", "mad.lo.u32 $0, s, 240, v;", "}"])


_E4M3_TO_BF16 = tl.constexpr(_e4m3_to_bf16_asm())
_X_UP = tl.constexpr(2.0 ** 64)     # bf16 x times 2^64, weights times 2^-120: products times 2^-56
_UNDO = tl.constexpr(2.0 ** 56)  # ... and the row scales times 2^56 back


@triton.jit
def _w_operand(w, MODE: tl.constexpr, CODES: tl.constexpr = 0, zoff=0.0):
    """The weight tile as the MMA's first operand (module docstring, MODE; CODES = UINT8: q - z in x's type, zoff as
    `tiles.code_values` takes it). The MoE decode kernel shares it (e4m3 codes)."""
    if CODES == UINT8:
        v = code_values(w, zoff, CODES, 2)              # the operand layout holds pairs along K
        if MODE == 0:
            return v.to(tl.bfloat16)
        elif MODE == 1:
            return v.to(tl.float16)
        else:
            return v
    elif MODE == 0:
        return tl.inline_asm_elementwise(_E4M3_TO_BF16, "=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=2)
    elif MODE == 1:
        return w.to(tl.float16)
    else:
        return w.to(tl.float32)


@triton.jit
def _x_operand(x, MODE: tl.constexpr, CODES: tl.constexpr = 0):
    """The x^T tile as the MMA's second operand (bf16 x against e4m3 codes: times 2^64)."""
    if MODE == 0 and CODES == E4M3:
        return x * _X_UP
    elif MODE == 2:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _row_values(ptrs, ROW_UNIFORM: tl.constexpr):
    """A K step's scales as fp32: one for the tile, or one per weight row [BLOCK_N, 1]."""
    if ROW_UNIFORM:
        return tl.load(ptrs).to(tl.float32)
    else:
        return tl.load(ptrs).to(tl.float32)[:, None]


@triton.jit
def _acc_step(acc, w_ptrs, s_ptrs, z_ptrs, xb, kmask, MODE: tl.constexpr, CODES: tl.constexpr, ZERO: tl.constexpr,
              ROW_UNIFORM: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + s * dot(weight tile, x tile) for one K step."""
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:               # masked inputs have x = 0, whatever the weight operand is there
        w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
    zoff = 0.0
    if CODES == UINT8:
        zoff = zero_offsets(z_ptrs, None, ZERO)
        if ZERO < 0 and not ROW_UNIFORM:
            zoff = zoff[:, None]
    if MODE == 2:
        part = tl.dot(_w_operand(w, MODE, CODES, zoff), xb, input_precision="ieee")
    else:
        part = tl.dot(_w_operand(w, MODE, CODES, zoff), xb)
    rs = _row_values(s_ptrs, ROW_UNIFORM)               # the tile's rows share one scale row: a scalar
    if MODE == 0 and CODES == E4M3:
        rs = rs * _UNDO
    return acc + part * rs


@triton.jit
def _fp8_mm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, rb_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N_OUT, K, stride_xm,
                   stride_wn, stride_sn, stride_om, UP, STEPS, BN: tl.constexpr, BK: tl.constexpr,
                   MODE: tl.constexpr, CODES: tl.constexpr, ZERO: tl.constexpr, HAS_RB: tl.constexpr,
                   ROW_UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                   GATED: tl.constexpr, CLAMP16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                   PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py
        gdc_wait()
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m, offs_n, rm, rn = tile_rows(pid_m, pid_n, M, N_OUT, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]       # x^T [BLOCK_K, BLOCK_M]
    wg_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]     # [BLOCK_N, BLOCK_K]
    wu_ptrs = wg_ptrs + UP * stride_wn
    if ROW_UNIFORM:                                   # zero points: at the scales' offsets
        sg_offs = ((pid_n * BLOCK_N) // BN) * stride_sn
        su_offs = ((pid_n * BLOCK_N + UP) // BN) * stride_sn
    else:
        sg_offs = _scale_rows(rb_ptr, rn, BN, HAS_RB) * stride_sn
        su_offs = _scale_rows(rb_ptr, rn + UP, BN, HAS_RB) * stride_sn
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    step_lo = 0
    step_hi = tl.cdiv(K, BLOCK_K)
    if SPLIT > 1:                                     # this program's share of the K steps
        step_lo = tl.program_id(1) * STEPS
        step_hi = tl.minimum(step_lo + STEPS, step_hi)
    for step in range(step_lo, step_hi):
        k0 = step * BLOCK_K
        kb = k0 // BK
        kmask = (k0 + offs_k) < K
        if EVEN_K:
            xt = tl.load(x_ptrs + k0)
        else:
            xt = tl.load(x_ptrs + k0, mask=kmask[:, None], other=0.0)
        xb = _x_operand(xt, MODE, CODES)
        acc_g = _acc_step(acc_g, wg_ptrs + k0, s_ptr + sg_offs + kb, z_ptr + sg_offs + kb, xb, kmask, MODE, CODES,
                          ZERO, ROW_UNIFORM, EVEN_K)
        if GATED:
            acc_u = _acc_step(acc_u, wu_ptrs + k0, s_ptr + su_offs + kb, z_ptr + su_offs + kb, xb, kmask, MODE,
                              CODES, ZERO, ROW_UNIFORM, EVEN_K)
    if PDL:
        gdc_launch_dependents()
    g = tl.trans(acc_g)                               # [BLOCK_M, BLOCK_N]: row-major, coalesced stores
    u = tl.trans(acc_u)
    mask = (offs_m < M)[:, None] & (offs_n < N_OUT)[None, :]
    splitk_store(g, u, ws_ptr, cnt_ptr, pid, out_ptr, b_ptr, rn, offs_m, offs_n, mask, M, N_OUT, stride_om, SPLIT,
                 HAS_BIAS, GATED, CLAMP16)


class Fp8MmConfig(NamedTuple):
    block_m: int         # x rows per tile (the MMA's N side; 16 at least)
    block_n: int         # weight rows per tile (the MMA's M side: 64 per warpgroup)
    block_k: int         # K per step (clipped to the largest power of two dividing bk)
    num_warps: int
    num_stages: int
    split_k: int = 0     # 0: `splitk.plan`'s choice (>= 2 programs per SM); 1: no split


# No candidate spills registers for 16-bit x (ptxas, sm_90; 64 x 128 tiles of 64 rows on 4 warps and the 128-row
# tile gated do). Reasoned from the bf16 DOT GEMV's measured tiles (`gemv.FEW_ROWS`: 64 x 256 bf16 = 32 KB per stage,
# 4 stages) at half the bytes per weight: 64 rows x 128 inputs (one scale block) = 8 KB per stage, 6 stages, and
# split-K for 2 programs per SM; 64 rows of x: 128 weight rows per tile over two warpgroups (acc 32 registers a
# thread). `orinfer.bench.fp8_kernels --sweep` times the candidates on the device.
DECODE_16 = Fp8MmConfig(16, 64, 128, 4, 6)
DECODE_32 = Fp8MmConfig(32, 64, 128, 4, 5)
DECODE_64 = Fp8MmConfig(64, 128, 128, 8, 4)
DECODE_128 = Fp8MmConfig(128, 128, 128, 8, 3)
CANDIDATES = [Fp8MmConfig(*c) for c in [(16, 64, 128, 4, 6), (16, 64, 128, 4, 4), (16, 128, 128, 4, 4),
                                        (16, 64, 64, 4, 8), (16, 128, 128, 8, 4), (16, 64, 128, 4, 6, 1),
                                        (16, 64, 128, 4, 6, 8), (32, 64, 128, 4, 5), (32, 128, 128, 8, 4),
                                        (64, 128, 128, 8, 4), (64, 64, 128, 4, 4), (64, 128, 128, 8, 4, 1)]]


def decode_config(rows: int) -> Fp8MmConfig:
    """The default tile for `rows` rows of x."""
    return DECODE_16 if rows <= 16 else DECODE_32 if rows <= 32 else DECODE_64 if rows <= 64 else DECODE_128


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (132 for the CPU interpreter: an H100's)."""
    return cuda_sm_count(device) or 132


def fp8_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
           row_block: torch.Tensor | None = None, bias: torch.Tensor | None = None, gated: bool = False,
           cfg: Fp8MmConfig | None = None, zeros: torch.Tensor | int | None = None) -> torch.Tensor:
    """y = x W^T (+ b) [..., N] in x's dtype for x [..., K] fp32/fp16/bf16 (gated: weight is a packed [2I, K] gate_up
    and y = silu(x Wg^T) * (x Wu^T) [..., I]). Needs bk % 16 == 0; `cfg` forces a tile (benchmarks, tests). `zeros`:
    uint8 codes with these zero points, or this one zero point (module docstring)."""
    check_device(x)
    k = x.shape[-1]
    n_out = check_fp8_weight(weight, scale, block_size, row_block, k, bias, gated, zeros)
    bn, bk = block_size
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or bk % 16:
        raise ValueError(f"fp8_mm takes fp32/fp16/bf16 x and bk % 16 == 0; got {x.dtype}, bk {bk}")
    x2 = as_rows(x)
    m = x2.shape[0]
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0 or n_out == 0:
        return out.reshape(*x.shape[:-1], n_out)
    mode = PLAIN if x.dtype == torch.float32 or interpreting() else A16_FP16 if x.dtype == torch.float16 else A16_BF16
    cfg = cfg or decode_config(m)
    block_k = min(cfg.block_k, bk & -bk)
    if mode == PLAIN and not interpreting():
        block_k = min(block_k, 32)     # exact fp32 dots are FMA loops: larger tiles spill (ptxas, sm_90)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_out, cfg.block_n)
    steps = triton.cdiv(k, block_k)
    split, per_split = plan(tiles, steps, cfg.split_k, sm_count(x.device))
    ws = torch.empty(split, 2 if gated else 1, m, n_out, dtype=torch.float32, device=x.device) if split > 1 else out
    # One scale row for a whole tile (Qwen's shapes): a scalar load per step instead of one per row.
    row_uniform = row_block is None and bn % cfg.block_n == 0 and (not gated or n_out % bn == 0)
    pdl = use_pdl(x2)
    z = zeros if isinstance(zeros, torch.Tensor) else scale                 # any pointer when not read
    _fp8_mm_kernel[(tiles, split)](
        x2, weight, scale, z, scale if row_block is None else row_block,
        out if bias is None else bias, out, ws, counters(x.device) if split > 1 else scale, m, n_out, k, x2.stride(0),
        weight.stride(0), scale.stride(0), out.stride(0), n_out if gated else 0, per_split, BN=bn, BK=bk, MODE=mode,
        **code_args(zeros), HAS_RB=row_block is not None,
        ROW_UNIFORM=row_uniform, HAS_BIAS=bias is not None, GATED=gated, CLAMP16=x.dtype == torch.float16,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8, SPLIT=split, EVEN_K=k % block_k == 0,
        PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    return out.reshape(*x.shape[:-1], n_out)
