"""FP8 block-wise W8A16 GEMV for decode: y = x W^T (+ b) for a few rows of x, W read once as FP8 and dequantised in
registers with its block scales (kernels/fp8_block.py has the format and the reference).

Math: x [B, K] (B <= MAX_ROWS; fp32, fp16 or bf16), weight [N, K] float8_e4m3fn row-major, scale [R, ceil(K / bk)]
fp32, row_block [N] int32 (output row -> scale row; None: n // bn), b [N]. Each weight tile [BLOCK_N, BLOCK_K] lies in
one column block (BLOCK_K divides bk), so it takes one scale per row: acc[b, n] += s[n] * sum_k w[n, k] x[b, k], all in
fp32; the result is rounded once to x's dtype.

Grid: (cdiv(N, BLOCK_N),); each program owns BLOCK_N output rows for all B rows of x, so the weight is read once.
Traffic: N*K bytes of weight + N*K/(bn*bk)*4 of scales + B*K + B*N activations: about half the bytes of the bf16 GEMV,
so the target is N*K / (HBM read bandwidth) (Qwen3-8B's down_proj, 50 MB in FP8: ~12 us on an H200).
A first, untuned kernel: one config, FMA tiles, no tensor cores; prefill (more rows) dequantises and uses cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.fp8_block import FP8_DTYPE, fp8_block_linear_ref
from orinfer.kernels.gemv import check_device

MAX_ROWS = 16
BLOCK_N = 32


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, rb_ptr, b_ptr, y_ptr, N, K, stride_x, stride_w, stride_s, stride_y,
                     BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr, HAS_RB: tl.constexpr,
                     HAS_BIAS: tl.constexpr, FP16_OUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if HAS_RB:
        srow = tl.load(rb_ptr + offs_n, mask=mask_n, other=0)
    else:
        srow = offs_n // BN
    offs_k = tl.arange(0, BLOCK_K)
    for b in range(ROWS):
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_w + ks[None, :], mask=mask_n[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)
            x = tl.load(x_ptr + b * stride_x + ks, mask=mask_k, other=0.0).to(tl.float32)
            s = tl.load(s_ptr + srow * stride_s + k0 // BK, mask=mask_n, other=0.0)
            acc += tl.sum(w * x[None, :], axis=1) * s
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if FP16_OUT:  # the fp16 guard of the reference (`fp16_guard`)
            acc = tl.minimum(tl.maximum(acc, -65504.0), 65504.0)
        tl.store(y_ptr + b * stride_y + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


def _block_k(bk: int) -> int:
    """The largest power of two <= 128 that divides bk: a tile never straddles two column blocks."""
    return min(128, bk & -bk)


def fp8_block_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                   row_block: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) in x's dtype for x [..., K] with at most MAX_ROWS rows (`fp8_block_linear_ref`'s contract)."""
    check_device(weight)
    n, k = weight.shape
    bn, bk = block_size
    x2 = x.reshape(-1, k)
    if x.shape[-1] != k or x2.shape[0] > MAX_ROWS or weight.dtype != FP8_DTYPE or weight.stride(1) != 1:
        raise ValueError(f"fp8_block_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} {weight.dtype} "
                         f"need x [<= {MAX_ROWS} rows, K], a row-major float8_e4m3fn weight")
    rows = scale.shape[0] if row_block is not None else -(-n // bn)
    if scale.shape != (rows, -(-k // bk)) or scale.dtype != torch.float32:
        raise ValueError(f"fp8_block_gemv: scales {tuple(scale.shape)} {scale.dtype} do not fit blocks {block_size}")
    x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    rb = row_block if row_block is not None else scale  # a placeholder pointer when unused
    b = bias if bias is not None else scale
    scale = scale.contiguous()
    _fp8_gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x2, weight, scale, rb, b, y, n, k, x2.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        BN=bn, BK=bk, ROWS=x2.shape[0], HAS_RB=row_block is not None, HAS_BIAS=bias is not None,
        FP16_OUT=x.dtype == torch.float16, BLOCK_N=BLOCK_N, BLOCK_K=_block_k(bk))
    return y.reshape(*x.shape[:-1], n)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int],
                     row_block: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The triton backend's FP8 linear: the GEMV for decode-sized inputs, else the weight dequantised and cuBLAS."""
    if x.numel() <= MAX_ROWS * x.shape[-1] and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return fp8_block_gemv(x, weight, scale, block_size, row_block, bias)
    return fp8_block_linear_ref(x, weight, scale, block_size, row_block, bias)
