"""The op table a backend provides to the layers.

Layers never call a kernel directly: they call `ops.<name>`, and the backend decides whether that is the pure-torch
reference (the `torch` backend: CPU and GPU, the correctness baseline) or a fused Triton kernel (the `triton`
backend). Both tables have the same signatures, so one model definition serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from orinfer.errors import ConfigError
from orinfer.kernels.activation import silu_and_mul_ref
from orinfer.kernels.attention import paged_attention_ref, store_kv_ref, varlen_causal_attention_ref
from orinfer.kernels.norm import rms_norm_ref
from orinfer.kernels.rotary import qk_norm_rope_ref
from orinfer.kernels.w4 import w4_gate_up_silu_ref, w4_linear_ref
from orinfer.kernels.vision import (bias_gelu_ref, bias_residual_ref, layer_norm_ref, qkv_split_rope_ref,
                                    vision_attention_ref)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b in x's dtype. In mixed mode (fp32 x, 16-bit W) the weight is widened, so products are fp32."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)


def lm_head_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits: x W^T in x's dtype (`linear_ref`), returned as fp32, as HF's models return them."""
    return linear_ref(x, weight).float()


def linear_bias_gelu_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh"
                         ) -> torch.Tensor:
    """gelu(x W^T + b): the bias-free GEMM, then `bias_gelu_ref` (the bias add rounded to x's dtype, as HF's Linear
    with bias rounds it)."""
    return bias_gelu_ref(linear_ref(x, weight), bias, approximate)


@dataclass(frozen=True)
class Ops:
    name: str
    linear: Callable
    rms_norm: Callable
    qk_norm_rope: Callable
    silu_and_mul: Callable
    store_kv: Callable
    paged_attention: Callable
    varlen_attention: Callable
    # The fused gate/up+SwiGLU GEMV for decode; None means "GEMM then silu_and_mul".
    fused_gate_up_silu: Callable | None = None
    # INT4 linears over the W4 layout (kernels/w4.py): w4_linear(x, w4, bias) and the fused gate/up + SwiGLU
    # w4_gate_up_silu(x, w4) for decode (None: w4_linear + silu_and_mul).
    w4_linear: Callable = w4_linear_ref
    w4_gate_up_silu: Callable | None = None
    # RMSNorm (+ residual add) whose output goes to a batch-1 AWQ linear as int16 words (`kernels/w4_words.py`):
    # rms_norm's signature, a `W4Words` in place of the normed row; w4_linear and w4_gate_up_silu then take those.
    # None: the backend has no words (the torch reference).
    rms_norm_words: Callable | None = None
    # prefetch_weights(linear, fraction=1.0): ask L2 for (the first rows of) a linear's decode weights in the
    # background, from where the call is (`kernels/l2_prefetch.py`: only inside the decode graphs' capture). None:
    # the backend does not prefetch.
    prefetch_weights: Callable | None = None
    # lm_head_ref's contract: fp32 logits with the values of the linear in x's dtype.
    lm_head: Callable = lm_head_ref
    # The Qwen3-VL vision tower's ops (kernels/vision.py documents each signature).
    layer_norm: Callable = layer_norm_ref
    bias_gelu: Callable = bias_gelu_ref
    bias_residual: Callable = bias_residual_ref
    qkv_split_rope: Callable = qkv_split_rope_ref
    vision_attention: Callable = vision_attention_ref
    # fc1 of the vision MLP: gelu(x W^T + b) (linear_bias_gelu_ref's contract).
    linear_bias_gelu: Callable = linear_bias_gelu_ref


TORCH_OPS = Ops(
    name="torch", linear=linear_ref, rms_norm=rms_norm_ref, qk_norm_rope=qk_norm_rope_ref,
    silu_and_mul=silu_and_mul_ref, store_kv=store_kv_ref, paged_attention=paged_attention_ref,
    varlen_attention=varlen_causal_attention_ref, w4_linear=w4_linear_ref,
    w4_gate_up_silu=w4_gate_up_silu_ref,
)


def get_ops(backend: str, device: torch.device, fused_ffn: bool = True) -> Ops:
    """The op table for `backend` ("torch", "triton" or "auto": triton on CUDA when installed, else torch)."""
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if backend == "torch":
        return TORCH_OPS
    if backend == "triton":
        if device.type != "cuda":
            raise ConfigError("the triton backend needs a CUDA device; use backend='torch' on the CPU")
        from orinfer.layers.triton_ops import triton_ops  # imported lazily: triton is optional
        return triton_ops(fused_ffn=fused_ffn)
    raise ConfigError(f"unknown backend {backend!r}; use auto, torch or triton")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    try:
        import orinfer.layers.triton_ops  # noqa: F401
    except ImportError:
        return False
    return True
