"""SwiGLU activation on a packed gate/up projection, and the fused gate/up GEMV + SwiGLU for decode.

Math: gate_up [T, 2I] = [g | u]; out [T, I] = silu(g) * u = g / (1 + exp(-g)) * u.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from orinfer.kernels.gemv import MAX_ROWS, ONE_ROW, check_device, gemv_ref, one_row_config, run_gemv, supported


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure-torch SwiGLU in the activation dtype (as HF computes it)."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def fused_gate_up_silu_ref(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) for the packed [2I, H] weight (gate rows first): the unfused GEMM + SwiGLU."""
    return silu_and_mul_ref(gemv_ref(x, gate_up_weight))


@triton.jit
def silu_mul(g, u, out_ty: tl.constexpr):
    """silu(g) * u of fp32 g and u (values of dtype out_ty) in out_ty, rounded as `silu_and_mul_ref` rounds (the SwiGLU
    of `silu_and_mul` and of the FP8-feeding one, kernels/fp8_feed.py)."""
    s = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)  # F.silu rounds to the dtype before the product
    return (s * u).to(out_ty)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, inter, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    in_row = gu_ptr + row * stride_in
    g = tl.load(in_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(in_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, silu_mul(g, u, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton SwiGLU: gate_up [..., 2I] (last dim contiguous) -> new [..., I] in gate_up's dtype.

    Kernel: grid (rows, cdiv(I, 1024)); each program reads 1024 gate and 1024 up values of one row (fp32 math)
    and writes 1024 outputs. Traffic: 3*T*I elements (read 2, write 1), pure bandwidth.
    """
    check_device(gate_up)
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up's last dim must be even, got {two_i}")
    inter = two_i // 2
    lead = gate_up.shape[:-1]
    g2 = gate_up.reshape(-1, two_i)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    rows = g2.shape[0]
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows and inter:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](g2, out, inter, g2.stride(0), out.stride(0),
                                                                  BLOCK=block, num_warps=4)
    return out.reshape(*lead, inter)


def fused_gate_up_silu(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """One pass over the packed gate/up weight for decode: x [B, H], W [2I, H] -> silu(x Wg^T) * (x Wu^T) [B, I].

    Kernel: `kernels.gemv._gemv_kernel` with its GATED epilogue - each program accumulates BLOCK_N gate rows and
    the matching BLOCK_N up rows (fp32), rounds g and u to x's dtype, applies silu and the product, and writes
    BLOCK_N outputs; the intermediate [B, 2I] never touches memory. Traffic: 2*I*H weight elements + B*H + B*I
    (Qwen3-8B bf16: 201 MB, 49 us at 4.1 TB/s). Mixed mode (fp32 x, 16-bit W) widens W on load.
    More than MAX_ROWS rows (or another dtype pair): cuBLAS GEMM + `silu_and_mul`, which is what large batches want.
    """
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 0 or rows > MAX_ROWS or not supported(x, gate_up_weight):
        return silu_and_mul(gemv_ref(x, gate_up_weight))
    if (rows < FUSED_MIN_ROWS and x.dtype == gate_up_weight.dtype and x.dtype != torch.float32
            and one_row_config(False, x.shape[-1]) == ONE_ROW):
        return silu_and_mul(run_gemv(x, gate_up_weight, None, gated=False))
    return run_gemv(x, gate_up_weight, None, gated=True)


# Measured end to end on the H200 (Qwen3-8B bf16; docs/performance.md): at batch 1 the one-pass kernel made
# decode slower (211-212 tok/s) than GEMV + SwiGLU (238-239 tok/s), although in isolation it streams the weight at 98%
# of bandwidth; at 8 rows it is on par or ahead. Until that is understood, one 16-bit row takes the faster path,
# except where the unfused GEMV would not get ONE_ROW's wide tile either (K < 2048: a small model such as a draft
# Qwen3-0.6B): there fusing saves the SwiGLU launch and costs no bandwidth. H200, NOTES run 325: Qwen3-0.6B decode
# batch 1 1329 tok/s unfused, 1408 fused; Qwen3-8B 252 unfused, 248 fused (so its rows stay unfused).
FUSED_MIN_ROWS = 2
