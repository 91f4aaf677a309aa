"""The end of a Qwen3.5-MoE block in one kernel: the routed experts' sum plus the gated shared expert
(`moe.shared_expert_combine_ref`'s contract).

Math, per token t and channel h, in fp32, rounded once to the experts' dtype:

    out[t, h] = experts_out[t, h] + sigmoid(gate_logit[t]) * shared_out[t, h]

It replaces three torch kernels (sigmoid of the [T, 1] gate logit, the product, the sum: ~7 us a layer at batch 1
on an H200, nearly all launch latency) and their two [T, H] intermediates.

Shapes: experts_out, shared_out [T, H] (unit last stride, any row stride), gate_logit [T, 1] (any strides), one
float dtype for the two outputs (the gate's may differ). Grid (T, cdiv(H, BLOCK)). Bytes: 3 * T * H elements (two
read, one written) and T gate values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device
from orinfer.kernels.pdl import small_kernel_prologue, use_pdl

BLOCK = 1024  # channels a program: Qwen3.5-MoE's H = 2048 is two programs a token, 8 values a thread at 4 warps


@triton.jit
def _combine_kernel(exp_ptr, sh_ptr, gate_ptr, out_ptr, H, stride_e, stride_s, stride_g, stride_o,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # all three inputs come from earlier kernels of the step
        small_kernel_prologue()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    gate = 1.0 / (1.0 + tl.exp(-tl.load(gate_ptr + t * stride_g).to(tl.float32)))
    e = tl.load(exp_ptr + t * stride_e + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sh_ptr + t * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    out = e + gate * s
    tl.store(out_ptr + t * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def shared_expert_combine(experts_out: torch.Tensor, shared_out: torch.Tensor, gate_logit: torch.Tensor
                          ) -> torch.Tensor:
    """`shared_expert_combine_ref`'s contract: experts_out, shared_out [T, H], gate_logit [T, 1] -> [T, H] in
    experts_out's dtype."""
    check_device(experts_out)
    if (experts_out.dim() != 2 or shared_out.shape != experts_out.shape or gate_logit.dim() != 2
            or tuple(gate_logit.shape) != (experts_out.shape[0], 1)):
        raise ValueError(f"shared_expert_combine: experts_out {tuple(experts_out.shape)}, shared_out "
                         f"{tuple(shared_out.shape)}, gate_logit {tuple(gate_logit.shape)}: expected [T, H], [T, H] "
                         "and [T, 1]")
    if shared_out.dtype != experts_out.dtype or not experts_out.is_floating_point():
        raise ValueError(f"shared_expert_combine: experts_out {experts_out.dtype} and shared_out {shared_out.dtype} "
                         "must share one float dtype")
    experts_out, shared_out = _rows(experts_out), _rows(shared_out)
    tokens, hidden = experts_out.shape
    out = torch.empty(tokens, hidden, dtype=experts_out.dtype, device=experts_out.device)
    if tokens == 0 or hidden == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(hidden))
    pdl = use_pdl(experts_out)
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        experts_out, shared_out, gate_logit, out, hidden, experts_out.stride(0), shared_out.stride(0),
        gate_logit.stride(0), out.stride(0), BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out
