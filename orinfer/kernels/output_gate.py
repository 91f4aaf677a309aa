"""Qwen3.5's gated attention output in one launch: out * sigmoid(gate), the gate read in place from q_proj's output.

q_proj emits, per head, the query then a gate of the same width D; viewed per head that is q_and_gate [T, H, 2D],
and the gate of channel c = h D + d is q_and_gate[t, h, D + d]. HF's attention computes, in the activation dtype,

    y = out * sigmoid(gate)

so torch rounds twice: sigmoid(g) = 1 / (1 + expf(-g)) computed in fp32 (CUDA's expf, IEEE division) and rounded
to the dtype, then the product (exact in fp32 for 16-bit factors) rounded to the dtype. The kernel does the same
operations in the same order, so on a GPU it reproduces torch's bits in bf16, fp16 and fp32 (`tl.exp` would not: it
is ex2.approx, not expf; nor would `/`: Triton divides fp32 approximately).

In torch that is three kernels (reshape copies the strided gate, sigmoid, mul) and two [T, H D] intermediates: 7 T H D
elements of traffic and ~3 launches a full-attention layer. Here: one launch, 3 T H D elements (out and the gate
read, y written over out).

Shapes: out [T, H D] (unit last stride, any row stride), q_and_gate [T, H, 2D] (unit last stride, any other strides:
the per-head view of a column slice of the packed qkv output), one float dtype. Grid (T, cdiv(H D, BLOCK)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from orinfer.kernels.gemv import check_device
from orinfer.kernels.pdl import small_kernel_prologue, use_pdl
from orinfer.kernels.tiles import INTERPRETED

BLOCK = 1024  # channels a program: Qwen3.5-35B-A3B's 16 x 256 = 4096 is four programs a token


def attn_output_gate_ref(out: torch.Tensor, q_and_gate: torch.Tensor) -> torch.Tensor:
    """out [T, H D], q_and_gate [T, H, 2D] -> out * sigmoid(q_and_gate[:, :, D:]) as [T, H D], in HF's order: the
    sigmoid rounded to the dtype, then the product."""
    head_dim = q_and_gate.shape[-1] // 2
    gate = q_and_gate[..., head_dim:].reshape(out.shape)
    return out * torch.sigmoid(gate)


@triton.jit
def _sigmoid_as_torch(x):
    """1 / (1 + expf(-x)) in fp32 with CUDA's expf and an IEEE division: torch's sigmoid kernel, bit for bit."""
    if INTERPRETED:  # numpy's expf there (tests/test_output_gate.py checks the roundings in its arithmetic)
        e = tl.exp(-x)
    else:
        e = libdevice.exp(-x)
    return tl.math.div_rn(1.0, 1.0 + e)


@triton.jit
def _output_gate_kernel(out_ptr, qg_ptr, n, stride_o, stride_qt, stride_qh, D: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    if PDL:  # out comes from attention, the gate from q_proj: both earlier kernels of the step
        small_kernel_prologue()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    head = offs // D
    gate = tl.load(qg_ptr + t * stride_qt + head * stride_qh + D + (offs - head * D), mask=mask, other=0.0)
    o = tl.load(out_ptr + t * stride_o + offs, mask=mask, other=0.0)
    s = _sigmoid_as_torch(gate.to(tl.float32)).to(o.dtype)  # rounded to the dtype, as torch.sigmoid returns it
    y = o.to(tl.float32) * s.to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def attn_output_gate(out: torch.Tensor, q_and_gate: torch.Tensor) -> torch.Tensor:
    """`attn_output_gate_ref`'s contract in one launch, written over `out` (when it has a unit last stride) and
    returned: callers pass attention's freshly made output and use only the result."""
    check_device(out)
    if (out.dim() != 2 or q_and_gate.dim() != 3 or q_and_gate.shape[0] != out.shape[0]
            or q_and_gate.shape[-1] % 2 or q_and_gate.shape[1] * q_and_gate.shape[2] != 2 * out.shape[1]):
        raise ValueError(f"attn_output_gate: out {tuple(out.shape)}, q_and_gate {tuple(q_and_gate.shape)}: expected "
                         "[T, H D] and [T, H, 2D]")
    if q_and_gate.dtype != out.dtype or not out.is_floating_point():
        raise ValueError(f"attn_output_gate: out {out.dtype} and q_and_gate {q_and_gate.dtype} must share one float "
                         "dtype")
    if out.stride(-1) != 1:
        out = out.contiguous()
    if q_and_gate.stride(-1) != 1:
        q_and_gate = q_and_gate.contiguous()
    tokens, width = out.shape
    if tokens == 0 or width == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(width))
    pdl = use_pdl(out)
    _output_gate_kernel[(tokens, triton.cdiv(width, block))](
        out, q_and_gate, width, out.stride(0), q_and_gate.stride(0), q_and_gate.stride(1),
        D=q_and_gate.shape[-1] // 2, BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out
