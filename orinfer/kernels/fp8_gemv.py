"""FP8 block-wise W8A16 GEMV for one row of x (decode at batch 1), or two: y = x W^T (+ b), every FP8 weight byte read
once, dequantised in registers; optionally the fused gate/up + SwiGLU over a packed gate_up weight.

Math: x [1, K] (fp32, fp16 or bf16), weight [N, K] float8_e4m3fn row-major, scale [R, ceil(K / bk)] fp32 (W = q * s
of its [bn, bk] block; `kernels/fp8_block.py`), row_block [N] int32 (output row -> scale row; None: n // bn), b [N].

    y[n] = sum_c s[n, c // bk] * (sum_{k in chunk c} q[n, k] x[k])         chunks of VEC = 16 inputs, fp32 throughout

A chunk is one 16-byte load of a thread (16 FP8 weights of one row), and lies inside one scale block (bk % 16 == 0),
so its 16 products are summed in the thread's registers and the block scale is applied once per chunk: per weight one
e4m3 -> f16 -> f32 conversion (F2FP per two weights + HADD2.F32 on sm_90) and one FMA, the scale one FMA per 16. The
[BLOCK_N, BLOCK_K / 16] partial sums cross threads once, at the end. The result is rounded once to x's dtype (fp16
clamped to +-65504, as `fp8_block_linear_ref`); up to summation order it is the fp32 reference's, without the weight's
rounding to x's dtype that the reference does.

Grid (cdiv(N, BLOCK_N),): a program owns BLOCK_N rows and walks all of K in [BLOCK_N, BLOCK_K] tiles; thousands of small
programs keep enough 16-byte loads in flight (as the bf16 GEMV of `kernels/gemv.py`, no split-K, one launch, CUDA-graph
safe). GATED (packed gate_up [2I, K], gate rows first): a program also reads the up rows I + n and writes silu(g) * u
with g and u rounded to x's dtype first, as the unfused GEMV + `silu_and_mul` do.

Traffic: N*K bytes of weight + N*K/(bn*bk)*4 of scales + 2K of x (from L2/L1, per program) + 2N of output: half the
bf16 GEMV's bytes, so the target time is N*K / (HBM read bandwidth). Qwen3-8B in FP8: qkv 6144x4096 = 25 MB (6 us on an
H100 at 3.35 TB/s... 4.3 TB/s on an H200), o 4096x4096 = 17 MB, gate_up 24576x4096 = 101 MB, down 4096x12288 = 50 MB.
More rows: `kernels/fp8_mm.py` (tensor cores, split-K).

Two rows (TWO_ROWS, `_pair_loop`; a draft model's two catch-up rows): each weight tile is loaded and converted once
and meets both rows' x chunks, so the weight bytes stay those of one row and the FMAs double; the second row's
output follows the first's ([2, N]).

8-bit integer codes (the W8 layout of GPTQ-Int8, `kernels/w8.py`): the same kernel with CODES = UINT8, weight uint8
[N, K], scales fp16 [N, groups] with bn = 1 and bk = the group size, and zeros [N, groups] (the zero points, same
shape and strides as the scales; or one zero point for all, a constexpr: symmetric GPTQ's 128): y[n] = sum_c s[n, c] *
sum_{k in chunk c} (q[n, k] - z[n, c]) x[k], q - z formed exactly in fp32 (`tiles.code_values`: the byte put into
2^23's mantissa by one prmt and one FADD per weight, then the FMA; about 4.2 SASS instructions per weight). Traffic:
N*K bytes + 2 bytes of scale (+ 2 of zero point) per (row, group): 1.6% (3.1%) at groups of 128.

16-bit float weights (CODES = FLOAT16, bf16 or fp16 with no scales): the helpers `_rows_loop`, `_chunk_sums` and
`_load_x_chunks` take a chunk width VEC = 8, so that a chunk is still one 16-byte load, and skip the scales; the
MoE experts' one-token path of `kernels/moe_gemv16.py` uses them so (the dense bf16 GEMV is `kernels/gemv.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.fp8_block import FP8_DTYPE
from orinfer.kernels.gemv import check_device
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.tiles import FLOAT16, UINT8, code_args, code_values, epilogue, zero_offsets

VEC = 16  # FP8 weights per thread per load: 16 bytes, one LDG.128


class Fp8GemvConfig(NamedTuple):
    block_n: int    # output rows per program
    block_k: int    # inputs per step (a multiple of VEC)
    num_warps: int


# Chosen by analogy with the bf16 GEMV's measured batch-1 tile (`gemv.ONE_ROW`: 2 rows x 2048 bf16 = 8 KB per step,
# 2 warps, 8 16-byte loads in flight per thread) and by the SASS of the step (sm_90, compiled on the CPU): 4 rows x
# 2048 FP8 is the same 8 KB and 8 loads per thread, and x's conversion is shared by 4 rows: 3.4 instructions per weight
# in the loop (F2FP 0.5, HADD2.F32 1, FFMA 1; 2 rows: 3.8, 8 rows: 3.2); gated: 2 + 2 rows, the same bytes. The
# candidates are what `orinfer.bench.fp8_kernels --sweep` times on the device.
DEFAULT = Fp8GemvConfig(4, 2048, 2)
DEFAULT_GATED = Fp8GemvConfig(2, 2048, 2)
CANDIDATES = [Fp8GemvConfig(*c) for c in [(4, 2048, 2), (2, 2048, 2), (8, 1024, 2), (2, 4096, 2), (1, 4096, 2),
                                          (4, 4096, 4), (8, 2048, 4), (8, 512, 1), (4, 1024, 1), (16, 512, 2),
                                          (1, 2048, 1), (2, 1024, 1), (4, 512, 1), (1, 4096, 4), (2, 2048, 4),
                                          (1, 2048, 2), (2, 512, 1), (4, 2048, 4)]]


# Qwen3.5-35B-A3B's projections (hidden 2048: qkv 9216 x 2048, in_proj 12352 x 2048, o and out_proj 2048 x 4096), H100
# sweep (`orinfer.bench.gemv_sweep --fp8`, NOTES run 349): 2 rows on 4 warps was the fastest of 18 tiles on all four,
# 8.1 / 10.4 / 4.4 / 4.4 us against DEFAULT's 8.9 / 10.5 / 4.8 / 5.0; with 2048 outputs DEFAULT has only 512 programs.
# On Qwen3-8B's (4096 and wider) DEFAULT stays best or within 2% but for qkv (10.2 us against 10.9).
SHORT = Fp8GemvConfig(2, 2048, 4)


def default_config(n: int, k: int, gated: bool = False) -> Fp8GemvConfig:
    """The tile for one row against an [n (x 2 when gated), k] weight: SHORT when a side is 2048 or less and rows are
    at least SHORT's 2048 inputs long (shorter rows, as a 0.6B model's, were not measured: DEFAULT as before)."""
    if gated:
        return DEFAULT_GATED
    return SHORT if min(n, k) <= 2048 <= k else DEFAULT


@triton.jit
def _scale_rows(rb_ptr, rows, BN: tl.constexpr, HAS_RB: tl.constexpr):
    """The scale row of each weight row: row_block[row], or row // bn."""
    if HAS_RB:
        return tl.load(rb_ptr + rows).to(tl.int64)
    else:
        return (rows // BN).to(tl.int64)


@triton.jit
def _load_x_chunks(starts, ks, K, ok, CH: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr = 16):
    """x chunks as fp32 [CH, VEC]: chunk c is the VEC inputs at pointer starts[c] [CH], inputs ks[c] .. ks[c] + VEC-1
    of a row of K; unless EVEN_K, inputs at or past K and every input of a chunk whose ok[c] is false (ok None: all
    are true) read 0. Loaded as [CH, VEC / 8, 8] so that a thread holds a whole chunk (two 16-byte loads of bf16 for
    VEC = 16) in the layout of the weight tile's chunks; a plain [CH, 16] load would spread a chunk over two threads
    and cost a shuffle or a shared-memory round trip per step. VEC = 8 (16-bit weights): one 16-byte load."""
    v = tl.arange(0, VEC // 8)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    ptrs = starts[:, None, None] + v
    if EVEN_K:
        x = tl.load(ptrs)
    else:
        mask = (ks[:, None, None] + v) < K
        if ok is not None:
            mask = mask & ok[:, None, None]
        x = tl.load(ptrs, mask=mask, other=0.0)
    return tl.reshape(x, [CH, VEC]).to(tl.float32)


@triton.jit
def _load_x(x_ptr, k0, K, CH: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr = 16):
    """x[k0 + VEC c + v] as fp32 [CH, VEC] (`_load_x_chunks` of one contiguous row)."""
    ks = k0 + tl.arange(0, CH) * VEC
    return _load_x_chunks(x_ptr + ks, ks, K, None, CH, EVEN_K, VEC)


@triton.jit
def _load_tile(w_ptrs, s_ptrs, z_ptrs, kmask, smask, CODES: tl.constexpr, ZERO: tl.constexpr, EVEN_K: tl.constexpr):
    """One [CH, BLOCK_N, VEC] tile of weights as fp32 values before their scale (uint8 codes: q - z), and the scale
    of each (chunk, row) as fp32 (1.0 for FLOAT16 weights: s_ptrs and smask are not read)."""
    zoff = 0.0
    s = 1.0
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
        if CODES != FLOAT16:
            s = tl.load(s_ptrs).to(tl.float32)
        if CODES == UINT8:
            zoff = zero_offsets(z_ptrs, None, ZERO)
    else:
        w = tl.load(w_ptrs, mask=kmask[:, None, :], other=0.0, eviction_policy="evict_first")
        if CODES != FLOAT16:
            s = tl.load(s_ptrs, mask=smask[:, None], other=0.0).to(tl.float32)
        if CODES == UINT8:       # masked inputs have x = 0: any value of q - z times it is 0
            zoff = zero_offsets(z_ptrs, smask[:, None], ZERO)
    if CODES == UINT8 and ZERO < 0:
        zoff = zoff[:, :, None]
    return code_values(w, zoff, CODES), s


@triton.jit
def _scaled_sums(w, s, x, CODES: tl.constexpr):
    """[CH, BLOCK_N] s * (per-chunk sums of w * x) for a tile from `_load_tile` and x chunks [CH, VEC]."""
    sums = tl.sum(w * x[:, None, :], axis=2)
    if CODES != FLOAT16:
        sums = sums * s
    return sums


@triton.jit
def _chunk_sums(acc, w_ptrs, s_ptrs, z_ptrs, x, kmask, smask, CODES: tl.constexpr, ZERO: tl.constexpr,
                EVEN_K: tl.constexpr):
    """acc [CH, BLOCK_N] + s * (per-chunk sums of q * x) for one [CH, BLOCK_N, VEC] tile of weights (uint8 codes:
    of (q - z) * x; FLOAT16: 16-bit weights, no scale: s_ptrs and smask are not read)."""
    w, s = _load_tile(w_ptrs, s_ptrs, z_ptrs, kmask, smask, CODES, ZERO, EVEN_K)
    return acc + _scaled_sums(w, s, x, CODES)


@triton.jit
def _chunk_inputs(CH: tl.constexpr, VEC: tl.constexpr = 16):
    """[CH, VEC]: the inputs of a step's chunks, VEC c + v."""
    return tl.arange(0, CH)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _rows_loop(x_ptr, wg_ptrs, wu_ptrs, s_ptr, z_ptr, sg_offs, su_offs, K, BK: tl.constexpr, CODES: tl.constexpr,
               ZERO: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, VEC: tl.constexpr = 16):
    """The main loop of a one-row GEMV over all of K: (acc_g, acc_u) [CH, BLOCK_N] fp32 per-chunk partial sums (CH =
    BLOCK_K / VEC; acc_u only when GATED) of the weight rows at wg_ptrs (and wu_ptrs) [CH, BLOCK_N, VEC] (pointers of
    input VEC c + v) against x [K] contiguous; the rows' scales (and zero points) at s_ptr (z_ptr) + sg_offs (su_offs)
    [1, BLOCK_N] + scale column (none for FLOAT16 weights, whose chunks are VEC = 8). Tiles are [CH, BLOCK_N, VEC]:
    chunks first, so that the lanes of a warp take consecutive chunks of one row (512 contiguous bytes per load
    instruction) and each thread's rows share its x chunk. The caller reduces over the chunks (after signalling PDL
    dependents, say)."""
    CH: tl.constexpr = BLOCK_K // VEC
    offs_c = tl.arange(0, CH)
    kk = _chunk_inputs(CH, VEC)                                              # [CH, VEC] inputs of a step
    acc_g = tl.zeros([CH, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([CH, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        smask = (k0 + offs_c * VEC) < K
        sc = ((k0 + offs_c * VEC) // BK)[:, None]                             # each chunk's scale column
        x = _load_x(x_ptr, k0, K, CH, EVEN_K, VEC)
        acc_g = _chunk_sums(acc_g, wg_ptrs + k0, s_ptr + sg_offs + sc, z_ptr + sg_offs + sc, x, kmask, smask,
                            CODES, ZERO, EVEN_K)
        if GATED:
            acc_u = _chunk_sums(acc_u, wu_ptrs + k0, s_ptr + su_offs + sc, z_ptr + su_offs + sc, x, kmask, smask,
                                CODES, ZERO, EVEN_K)
    return acc_g, acc_u


@triton.jit
def _pair_loop(x_ptr, stride_xm, wg_ptrs, wu_ptrs, s_ptr, z_ptr, sg_offs, su_offs, K, BK: tl.constexpr,
               CODES: tl.constexpr, ZERO: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """`_rows_loop` for two rows of x (the second at x_ptr + stride_xm): each weight tile is loaded and converted
    once and meets both rows. Returns (acc_g, acc_u, acc_g1, acc_u1): the rows' partial sums, in that order."""
    CH: tl.constexpr = BLOCK_K // 16
    offs_c = tl.arange(0, CH)
    kk = _chunk_inputs(CH)
    acc_g = tl.zeros([CH, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([CH, BLOCK_N], dtype=tl.float32)
    acc_g1 = tl.zeros([CH, BLOCK_N], dtype=tl.float32)
    acc_u1 = tl.zeros([CH, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        smask = (k0 + offs_c * 16) < K
        sc = ((k0 + offs_c * 16) // BK)[:, None]
        x0 = _load_x(x_ptr, k0, K, CH, EVEN_K)
        x1 = _load_x(x_ptr + stride_xm, k0, K, CH, EVEN_K)
        w, s = _load_tile(wg_ptrs + k0, s_ptr + sg_offs + sc, z_ptr + sg_offs + sc, kmask, smask, CODES, ZERO, EVEN_K)
        acc_g += _scaled_sums(w, s, x0, CODES)
        acc_g1 += _scaled_sums(w, s, x1, CODES)
        if GATED:
            w, s = _load_tile(wu_ptrs + k0, s_ptr + su_offs + sc, z_ptr + su_offs + sc, kmask, smask, CODES, ZERO,
                              EVEN_K)
            acc_u += _scaled_sums(w, s, x0, CODES)
            acc_u1 += _scaled_sums(w, s, x1, CODES)
    return acc_g, acc_u, acc_g1, acc_u1


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, rb_ptr, b_ptr, out_ptr, N_OUT, K, stride_wn, stride_sn, UP,
                     stride_xm, BN: tl.constexpr, BK: tl.constexpr, CODES: tl.constexpr, ZERO: tl.constexpr,
                     HAS_RB: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, CLAMP16: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, TWO_ROWS: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py: wait for the previous kernel before touching memory
        gdc_wait()
    CH: tl.constexpr = BLOCK_K // 16
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(offs_n, N_OUT - 1)      # rows past N re-read row N-1 and are not stored: no row masks on loads
    wg_ptrs = w_ptr + rn.to(tl.int64)[None, :, None] * stride_wn + _chunk_inputs(CH)[:, None, :]
    sg_offs = _scale_rows(rb_ptr, rn, BN, HAS_RB)[None, :] * stride_sn    # zero points: the scales' offsets
    su_offs = sg_offs
    if GATED:
        su_offs = _scale_rows(rb_ptr, rn + UP, BN, HAS_RB)[None, :] * stride_sn
    if TWO_ROWS:
        acc_g, acc_u, acc_g1, acc_u1 = _pair_loop(x_ptr, stride_xm, wg_ptrs, wg_ptrs + UP * stride_wn, s_ptr, z_ptr,
                                                  sg_offs, su_offs, K, BK, CODES, ZERO, GATED, BLOCK_N, BLOCK_K,
                                                  EVEN_K)
    else:
        acc_g, acc_u = _rows_loop(x_ptr, wg_ptrs, wg_ptrs + UP * stride_wn, s_ptr, z_ptr, sg_offs, su_offs, K, BK,
                                  CODES, ZERO, GATED, BLOCK_N, BLOCK_K, EVEN_K)
    if PDL:  # the main loop is done: let the next kernel launch while this one reduces and stores
        gdc_launch_dependents()
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    stored = offs_n < N_OUT
    y = epilogue(tl.sum(acc_g, axis=0), tl.sum(acc_u, axis=0), bias, out_ty, HAS_BIAS, GATED, CLAMP16)
    tl.store(out_ptr + offs_n, y, mask=stored)
    if TWO_ROWS:
        y1 = epilogue(tl.sum(acc_g1, axis=0), tl.sum(acc_u1, axis=0), bias, out_ty, HAS_BIAS, GATED, CLAMP16)
        tl.store(out_ptr + N_OUT + offs_n, y1, mask=stored)


def check_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                     row_block: torch.Tensor | None, k: int, bias: torch.Tensor | None = None,
                     gated: bool = False, zeros: torch.Tensor | int | None = None) -> int:
    """The number of outputs (N, or N / 2 for a packed gate_up when `gated`); raises ValueError unless weight [N, k]
    is row-major float8_e4m3fn and scale [rows, ceil(k / bk)] fp32 fits it (rows = ceil(N / bn), or any count with a
    row_block [N] map) with unit last stride, and a bias is contiguous [outputs]. With `zeros` (8-bit integer codes,
    module docstring): weight uint8, scale fp16 or fp32, zeros of the scale's shape and strides, fp16 or fp32, or
    one zero point for all (an int 0..256)."""
    n = weight.shape[0]
    bn, bk = block_size
    fmt, codes = ("W8", torch.uint8) if zeros is not None else ("FP8", FP8_DTYPE)
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != codes or weight.stride(1) != 1:
        raise ValueError(f"{fmt} weight {tuple(weight.shape)} {weight.dtype} must be a row-major {codes} "
                         f"[N, {k}] matrix")
    rows = scale.shape[0] if row_block is not None else -(-n // bn)
    scale_types = (torch.float32,) if zeros is None else (torch.float32, torch.float16)
    if (scale.dim() != 2 or tuple(scale.shape) != (rows, -(-k // bk)) or scale.dtype not in scale_types
            or scale.stride(1) != 1):
        raise ValueError(f"{fmt} scales {tuple(scale.shape)} {scale.dtype} do not fit a weight {tuple(weight.shape)} "
                         f"in blocks {tuple(block_size)}")
    if isinstance(zeros, int) and not 0 <= zeros <= 256:
        raise ValueError(f"a uint8 code's zero point {zeros} is not in 0..256")
    if isinstance(zeros, torch.Tensor) and (zeros.shape != scale.shape or zeros.stride() != scale.stride()
                                            or zeros.dtype not in scale_types):
        raise ValueError(f"zero points {tuple(zeros.shape)} {zeros.dtype} must have the scales' shape and strides")
    if row_block is not None and (tuple(row_block.shape) != (n,) or row_block.dtype != torch.int32):
        raise ValueError(f"row_block must be int32 [{n}], got {tuple(row_block.shape)} {row_block.dtype}")
    if gated and n % 2:
        raise ValueError("a packed gate/up weight needs an even number of rows")
    n_out = n // 2 if gated else n
    if bias is not None and (tuple(bias.shape) != (n_out,) or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n_out} outputs")
    return n_out


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
             row_block: torch.Tensor | None = None, bias: torch.Tensor | None = None, gated: bool = False,
             cfg: Fp8GemvConfig | None = None, zeros: torch.Tensor | int | None = None) -> torch.Tensor:
    """y = x W^T (+ b) [..., N] for x [..., K] holding one or two rows, in x's dtype (`fp8_block_linear_ref`'s values up to
    summation order); gated: weight is a packed [2I, K] gate_up and the result silu(x Wg^T) * (x Wu^T) [..., I].
    Needs bk % 16 == 0 (Qwen's 128); `cfg` forces a tile (benchmarks, tests). `zeros`: uint8 codes with these zero
    points, or this one zero point (module docstring; `kernels/w8_ops.py` calls it so)."""
    check_device(x)
    k = x.shape[-1]
    n_out = check_fp8_weight(weight, scale, block_size, row_block, k, bias, gated, zeros)
    bn, bk = block_size
    if bk % VEC:
        raise ValueError(f"fp8_gemv needs a block width that is a multiple of {VEC}, got {bk}")
    rows = x.numel() // k if k else 0
    if rows not in (1, 2) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fp8_gemv takes one or two rows of fp32/fp16/bf16 x, got {tuple(x.shape)} {x.dtype}")
    x1 = x.reshape(rows, k).contiguous()
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    cfg = cfg or default_config(n_out, k, gated)
    block_k = min(cfg.block_k, max(VEC, triton.next_power_of_2(k)))   # short rows: one step, no masked-off chunks
    pdl = use_pdl(x1)
    z = zeros if isinstance(zeros, torch.Tensor) else scale                 # any pointer when not read
    _fp8_gemv_kernel[(triton.cdiv(n_out, cfg.block_n),)](
        x1, weight, scale, z, scale if row_block is None else row_block,
        scale if bias is None else bias, out, n_out, k, weight.stride(0), scale.stride(0), n_out if gated else 0,
        k, BN=bn, BK=bk, **code_args(zeros), HAS_RB=row_block is not None,
        HAS_BIAS=bias is not None, GATED=gated, CLAMP16=x.dtype == torch.float16, BLOCK_N=cfg.block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, TWO_ROWS=rows == 2, PDL=pdl, num_warps=cfg.num_warps,
        num_stages=1, launch_pdl=pdl)
    return out.reshape(*x.shape[:-1], n_out)
