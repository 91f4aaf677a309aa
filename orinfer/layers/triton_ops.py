"""The `triton` backend's op table: fused Triton kernels where they win, cuBLAS (torch) for large GEMMs.

linear: decode-sized inputs (at most GEMV_MAX_ROWS rows) against a large weight go to the Triton GEMV (which
itself falls back to cuBLAS for shapes where timing says cuBLAS is faster); everything else is `linear_ref`
(F.linear = cuBLAS, widening the weight in mixed mode). The other ops are the kernels of `orinfer.kernels`, each
with its reference's signature.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from orinfer.kernels.activation import fused_gate_up_silu, silu_and_mul
from orinfer.kernels.argmax import argmax_rows
from orinfer.kernels.attention import store_kv, varlen_attention
from orinfer.kernels.causal_conv import causal_conv1d
from orinfer.kernels.decode_attention import paged_attention
from orinfer.kernels.decode_inputs import advance_decode_inputs
from orinfer.kernels.gated_delta_decode import gated_delta_advance, gated_delta_decode_step
from orinfer.kernels.gated_delta_fla import gated_delta_rule
from orinfer.kernels.gated_norm import gated_rms_norm
from orinfer.kernels.gemv import gemv, supported
from orinfer.kernels.l2_prefetch import prefetch_scope, prefetch_weights
from orinfer.kernels import moe_router as fused_router
from orinfer.kernels.moe import moe_router_ref
from orinfer.kernels.moe_ops import fused_moe, fused_moe_fp8, fused_moe_w4, moe_route
from orinfer.kernels.moe_shared import shared_expert_combine
from orinfer.kernels.norm import rms_norm
from orinfer.kernels.output_gate import attn_output_gate
from orinfer.kernels.rotary import qk_norm_rope
from orinfer.kernels.vision import bias_gelu, bias_residual, layer_norm, qkv_split_rope, vision_attention
from orinfer.kernels.fp8_feed import rms_norm_fp8
from orinfer.kernels.fp8_ops import fp8_block_linear, fp8_gate_up_silu, takes_act, unfused_fp8_gate_up_silu
from orinfer.kernels.w4 import W4Weight
from orinfer.kernels.w4_ops import w4_gate_up_silu, w4_linear
from orinfer.kernels.w8_ops import unfused_w8_gate_up_silu, w8_gate_up_silu, w8_linear
from orinfer.kernels.w4_words import W4Words, rms_norm_words
from orinfer.layers.decode_hooks import install_decode_hooks
from orinfer.layers.ops import GraphHooks, Ops, linear_ref, lm_head_ref

GEMV_MAX_ROWS = 8
GEMV_MIN_WEIGHT = 1 << 20  # elements; smaller weights (tiny test models) are latency-bound either way


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Decode-sized x against a large row-major weight, in a dtype pair the GEMV handles."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (0 < rows <= GEMV_MAX_ROWS and weight.numel() >= GEMV_MIN_WEIGHT and weight.stride(-1) == 1
            and supported(x, weight))


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_ref`'s contract; the GEMV kernel for decode-sized x and large row-major weights."""
    return gemv(x, weight, bias) if _gemv_applies(x, weight) else linear_ref(x, weight, bias)


def triton_lm_head(x: torch.Tensor, weight: torch.Tensor, widen: bool = True) -> torch.Tensor:
    """`lm_head_ref`'s contract: decode-sized x through the GEMV, which stores the fp32 logits itself (one copy
    kernel less per step); otherwise the linear, then the widening."""
    if _gemv_applies(x, weight):
        return gemv(x, weight, out_dtype=torch.float32 if widen else None)
    return lm_head_ref(x, weight, widen)


def segment_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int | None, scale: float, bounds: Sequence[int] | None = None
                            ) -> torch.Tensor:
    """`vision_attention_ref`'s contract through PyTorch's flash SDPA, one call per image (16-bit CUDA inputs).

    Measured on the H200 (one 1024x768 image, H = 16, Dh = 72): 139 us at 313 TFLOP/s
    against 492 us for our Triton kernel (head padded to 128 in 16-bit), so the tower uses it where it applies; the
    Triton kernel serves fp32. The segment bounds come from the host (`bounds`, the tower's own list): reading
    them back from cu_seqlens cost a sync per layer, 5 ms of GPU idle time per 1024x768 image."""
    if q.dtype == torch.float32:
        return vision_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    heads, tokens, head_dim = q.shape
    bounds = cu_seqlens.tolist() if bounds is None else list(bounds)
    if bounds == [0, tokens]:  # one image: token-major q/k/v (`qkv_split_rope`) give a [N, H, Dh] output as is
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale)
        return o[0].transpose(0, 1).reshape(tokens, heads * head_dim)
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    for begin, end in zip(bounds[:-1], bounds[1:]):
        if end > begin:
            o = F.scaled_dot_product_attention(q[None, :, begin:end], k[None, :, begin:end], v[None, :, begin:end],
                                               scale=scale)
            out[begin:end] = o[0].transpose(0, 1)
    return out.view(tokens, heads * head_dim)


def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh"
                     ) -> torch.Tensor:
    """`linear_bias_gelu_ref`'s contract: gelu(x W^T + b). For the tanh GELU on CUDA, one cuBLASLt GEMM with the
    bias and GELU in its epilogue (torch._addmm_activation; on CUDA its GELU is the tanh form;
    on the CPU it is erf, hence CUDA only): on Qwen3-VL-8B's fc1 (3072 x 1152 -> 4304) 69-70 us against 80-87 us
    for the GEMM + `bias_gelu`, and the tower's graph 9.78 against 9.96 ms. The epilogue adds
    the bias to the fp32 accumulator, one rounding fewer than the reference. Otherwise (erf GELU, fp32 or mixed
    dtypes, CPU) the GEMM then `bias_gelu`."""
    if (approximate == "tanh" and x.is_cuda and x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and bias.dtype == x.dtype):
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return bias_gelu(triton_linear(x, weight), bias, approximate)


def unfused_gate_up_silu(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """`gate_up_silu` as two kernels: the linear, then `silu_and_mul` (`--no-fused-ffn`)."""
    return silu_and_mul(triton_linear(x, gate_up_weight))


def unfused_w4_gate_up_silu(x: torch.Tensor | W4Words, w: W4Weight) -> torch.Tensor:
    """`w4_gate_up_silu` as two kernels: the W4 linear, then `silu_and_mul` (`--no-fused-ffn`)."""
    return silu_and_mul(w4_linear(x, w))


def triton_moe_router(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, num_experts: int,
                      fold_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`moe_router_ref`'s contract: decode-sized batches in one launch (kernels/moe_router.py: the GEMV, softmax,
    top-k and the shared gate's logit, or its folded pair), more tokens through the linear, then `moe_route` (which
    appends the folded pair in the same launch)."""
    if fused_router.supported(x, weight, top_k, num_experts, fold_shared):
        return fused_router.moe_router(x, weight, top_k, renormalize, num_experts, fold_shared)
    return moe_router_ref(x, weight, top_k, renormalize, num_experts, fold_shared, linear=triton_linear,
                          route=moe_route)


GRAPH_HOOKS = GraphHooks(argmax_rows=argmax_rows, advance_decode_inputs=advance_decode_inputs,
                         capture_scope=prefetch_scope)


def triton_ops(fused_ffn: bool = True) -> Ops:
    """The Triton op table; fused_ffn=False (`--no-fused-ffn`) makes decode run gate/up GEMV + silu_and_mul."""
    return Ops(
        name="triton", linear=triton_linear, rms_norm=rms_norm, qk_norm_rope=qk_norm_rope,
        silu_and_mul=silu_and_mul, store_kv=store_kv, paged_attention=paged_attention,
        varlen_attention=varlen_attention, gate_up_silu=fused_gate_up_silu if fused_ffn else unfused_gate_up_silu,
        w4_linear=w4_linear, w4_gate_up_silu=w4_gate_up_silu if fused_ffn else unfused_w4_gate_up_silu,
        fp8_block_linear=fp8_block_linear,
        fp8_gate_up_silu=fp8_gate_up_silu if fused_ffn else unfused_fp8_gate_up_silu, w8_linear=w8_linear,
        w8_gate_up_silu=w8_gate_up_silu if fused_ffn else unfused_w8_gate_up_silu,
        fp8_takes_act=takes_act, rms_norm_fp8=rms_norm_fp8, rms_norm_words=rms_norm_words, layer_norm=layer_norm,
        bias_gelu=bias_gelu, bias_residual=bias_residual,
        qkv_split_rope=qkv_split_rope, vision_attention=segment_flash_attention, linear_bias_gelu=linear_bias_gelu,
        lm_head=triton_lm_head, prefetch_weights=prefetch_weights, install_hooks=install_decode_hooks,
        graph_hooks=GRAPH_HOOKS, materializes_attention=False, causal_conv1d=causal_conv1d,
        gated_delta_rule=gated_delta_rule, gated_rms_norm=gated_rms_norm,
        gated_delta_decode_step=gated_delta_decode_step, gated_delta_advance=gated_delta_advance,
        attn_output_gate=attn_output_gate,
        moe_route=moe_route, fused_moe=fused_moe, fused_moe_fp8=fused_moe_fp8, fused_moe_w4=fused_moe_w4,
        moe_router=triton_moe_router, shared_expert_combine=shared_expert_combine,
    )
