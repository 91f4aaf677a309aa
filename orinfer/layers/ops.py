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
from orinfer.kernels.activation import fused_gate_up_silu_ref, silu_and_mul_ref
from orinfer.kernels.attention import paged_attention_ref, store_kv_ref, varlen_causal_attention_ref
from orinfer.kernels.fp8_block import fp8_block_linear_ref, fp8_gate_up_silu_ref
from orinfer.kernels.gated_delta import (FUSED_STEP_MAX_ROWS, causal_conv1d_ref, gated_delta_advance_ref,
                                        gated_delta_decode_step_ref, gated_delta_rule_ref, gated_rms_norm_ref)
from orinfer.kernels.gptq import gptq_linear_ref
from orinfer.kernels.moe import fused_moe_ref, moe_route_ref, moe_router_ref, shared_expert_combine_ref
from orinfer.kernels.moe_fp8 import fused_moe_fp8_ref
from orinfer.kernels.moe_w4 import fused_moe_w4_ref
from orinfer.kernels.norm import rms_norm_ref
from orinfer.kernels.output_gate import attn_output_gate_ref
from orinfer.kernels.rotary import qk_norm_rope_ref
from orinfer.kernels.w4 import w4_gate_up_silu_ref, w4_linear_ref
from orinfer.kernels.w8 import w8_gate_up_silu_ref, w8_linear_ref
from orinfer.kernels.vision import (bias_gelu_ref, bias_residual_ref, layer_norm_ref, qkv_split_rope_ref,
                                    vision_attention_ref)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b in x's dtype. In mixed mode (fp32 x, 16-bit W) the weight is widened, so products are fp32."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)


def lm_head_ref(x: torch.Tensor, weight: torch.Tensor, widen: bool = True) -> torch.Tensor:
    """Logits: x W^T in x's dtype (`linear_ref`), returned as fp32, as HF's models return them; widen=False returns
    them in x's dtype (a vocab-parallel head gathers those, half the bytes, and widens them as it reorders them)."""
    y = linear_ref(x, weight)
    return y.float() if widen else y


def linear_bias_gelu_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh"
                         ) -> torch.Tensor:
    """gelu(x W^T + b): the bias-free GEMM, then `bias_gelu_ref` (the bias add rounded to x's dtype, as HF's Linear
    with bias rounds it)."""
    return bias_gelu_ref(linear_ref(x, weight), bias, approximate)


@dataclass(frozen=True)
class GraphHooks:
    """What a backend gives the CUDA-graph capture of decode steps (`engine/cuda_graph.py`). A backend without them
    (the torch reference, whose decode path syncs with the host) runs decode eagerly."""

    # argmax_rows(logits [B, V], out [B] int64, mirror [2, B'] pinned int64, mirror_row [1] int64): greedy ids into
    # `out` and into row mirror_row of `mirror`, inside the graph (kernels/argmax.py).
    argmax_rows: Callable
    # advance_decode_inputs(positions, context_lens, slot_mapping, block_tables, block_size, host_row): moves a
    # replayed step's inputs to the next token on the device (kernels/decode_inputs.py).
    advance_decode_inputs: Callable
    # capture_scope(device, launch) -> context manager opened around a graph's warm-up (launch=False) and its capture
    # (launch=True): where decode-only side work (L2 prefetch) is planned, then recorded.
    capture_scope: Callable


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
    # gate_up_silu(x, gate_up_weight [2I, H]) -> silu(x Wg^T) * (x Wu^T): a packed gate/up projection and SwiGLU;
    # the backend picks a fused kernel for the row counts where one exists.
    gate_up_silu: Callable = fused_gate_up_silu_ref
    # INT4 linears over the W4 layout (kernels/w4.py): w4_linear(x, w4, bias) and w4_gate_up_silu(x, w4) (as
    # gate_up_silu). x may be the `W4Words` that `rms_norm_words` made.
    w4_linear: Callable = w4_linear_ref
    w4_gate_up_silu: Callable = w4_gate_up_silu_ref
    # FP8 block-wise weights (kernels/fp8_block.py): fp8_block_linear(x, weight, scale, block_size, row_block, bias),
    # and fp8_gate_up_silu(x, weight, scale, block_size, row_block) for a packed gate_up (as gate_up_silu).
    fp8_block_linear: Callable = fp8_block_linear_ref
    fp8_gate_up_silu: Callable = fp8_gate_up_silu_ref
    # FP8 activation feeding (kernels/fp8_feed.py): fp8_takes_act(x, weight, scale, block_size, row_block) says whether
    # those two would quantize x themselves (W8A8) for x's rows, dtype and device; then they take an `Fp8Act` in
    # place of x, and fp8_gate_up_silu(..., act_group=G) returns its SwiGLU as one where it can (for a down projection
    # that takes it). rms_norm_fp8(x, weight, eps, residual, group): rms_norm's result as an Fp8Act. None: the
    # backend does not feed (the torch reference).
    fp8_takes_act: Callable | None = None
    rms_norm_fp8: Callable | None = None
    # GPTQ weights (kernels/gptq.py): gptq_linear(x, qweight, qzeros, scales, g_idx, bits, shards, bias).
    gptq_linear: Callable = gptq_linear_ref
    # 8-bit integer linears over the W8 layout (kernels/w8.py, GPTQ-Int8 repacked): w8_linear(x, w8, bias) and
    # w8_gate_up_silu(x, w8) (as gate_up_silu).
    w8_linear: Callable = w8_linear_ref
    w8_gate_up_silu: Callable = w8_gate_up_silu_ref
    # RMSNorm (+ residual add) whose output goes to a batch-1 AWQ linear as int16 words (`kernels/w4_words.py`):
    # rms_norm's signature, a `W4Words` in place of the normed row; w4_linear and w4_gate_up_silu then take those.
    # None: the backend has no words (the torch reference).
    rms_norm_words: Callable | None = None
    # prefetch_weights(linear, fraction=1.0): ask L2 for (the first rows of) a linear's decode weights in the
    # background, from where the call is (`kernels/l2_prefetch.py`: only inside the decode graphs' capture scope).
    # None: the backend does not prefetch.
    prefetch_weights: Callable | None = None
    # install_hooks(model): wires the backend's decode-only tricks (norms that hand words to their linear, L2
    # prefetch around attention) into a freshly built model, from the structure it declares (layers/decode_hooks.py).
    install_hooks: Callable | None = None
    # CUDA-graph capture of decode steps; None: decode runs eagerly.
    graph_hooks: GraphHooks | None = None
    # Whether attention materialises the [heads, N, N] scores (the torch reference does): memory quadratic in tokens,
    # so the vision tower's memory probe with the largest image is skipped.
    materializes_attention: bool = True
    # lm_head_ref's contract: fp32 logits with the values of the linear in x's dtype (in x's dtype with widen=False).
    lm_head: Callable = lm_head_ref
    # The Qwen3-VL vision tower's ops (kernels/vision.py documents each signature).
    layer_norm: Callable = layer_norm_ref
    bias_gelu: Callable = bias_gelu_ref
    bias_residual: Callable = bias_residual_ref
    qkv_split_rope: Callable = qkv_split_rope_ref
    vision_attention: Callable = vision_attention_ref
    # fc1 of the vision MLP: gelu(x W^T + b) (linear_bias_gelu_ref's contract).
    linear_bias_gelu: Callable = linear_bias_gelu_ref
    # Gated DeltaNet (Qwen3.5's linear attention; kernels/gated_delta.py documents each signature and the state
    # slots they update in place).
    causal_conv1d: Callable = causal_conv1d_ref
    gated_delta_rule: Callable = gated_delta_rule_ref
    gated_rms_norm: Callable = gated_rms_norm_ref
    # gated_delta_decode_step(mixed, z, gates, conv_weight, A_log, dt_bias, norm_weight, eps, query_start_loc,
    # conv_states, ssm_states, state_slots, has_initial_state, max_rows_per_seq) -> the normed output [T, Hv Dv]:
    # the three above in one step, for batches of at most max_rows_per_seq rows a sequence (the triton backend fuses
    # them into one kernel). gated_delta_advance(mixed, gates, conv_weight, A_log, dt_bias, query_start_loc,
    # conv_states, ssm_states, state_slots, has_initial_state, max_rows_per_seq): its state updates alone (no
    # output), as the speculative state rollback replays accepted rows. Models take both for batches of at most
    # gated_delta_step_max_rows rows a sequence (decode, verify steps), the three ops above for longer rows.
    gated_delta_decode_step: Callable = gated_delta_decode_step_ref
    gated_delta_advance: Callable = gated_delta_advance_ref
    gated_delta_step_max_rows: int = FUSED_STEP_MAX_ROWS
    # attn_output_gate(out [T, H D], q_and_gate [T, H, 2D]) -> out * sigmoid(q_and_gate[:, :, D:]) [T, H D]: Qwen3.5's
    # gated attention output (kernels/output_gate.py). It may write over `out`: pass attention's fresh output and use
    # only the result.
    attn_output_gate: Callable = attn_output_gate_ref
    # Mixture of experts (kernels/moe.py documents both): moe_route(router_logits, top_k, renormalize,
    # shared_logit=None) -> (weights, ids), a folded shared expert's pair appended when shared_logit is given;
    # fused_moe(x, w13, w2, weights, ids) -> the experts' weighted sum.
    moe_route: Callable = moe_route_ref
    fused_moe: Callable = fused_moe_ref
    # moe_router(x, router_weight [E or E + 1, H], top_k, renormalize, num_experts, fold_shared=False) -> (weights,
    # ids, shared gate logit [T, 1] or None): the router's linear and moe_route in one op, the packed shared-expert
    # gate row split off, or with fold_shared turned into each token's (k+1)-th pair, (sigmoid(logit), E)
    # (kernels/moe.py; the triton backend fuses it into one launch for decode-sized batches).
    moe_router: Callable = moe_router_ref
    # shared_expert_combine(experts_out, shared_out, gate_logit [T, 1]) -> experts_out + sigmoid(gate) * shared_out.
    shared_expert_combine: Callable = shared_expert_combine_ref
    # fused_moe_fp8(x, w13, s13, w2, s2, block_size, weights, ids): the same over FP8 block-wise experts
    # (kernels/moe_fp8.py).
    fused_moe_fp8: Callable = fused_moe_fp8_ref
    # fused_moe_w4(x, w13, w2, weights, ids): over 4-bit AWQ / GPTQ experts in the W4 layout (kernels/moe_w4.py).
    fused_moe_w4: Callable = fused_moe_w4_ref


TORCH_OPS = Ops(
    name="torch", linear=linear_ref, rms_norm=rms_norm_ref, qk_norm_rope=qk_norm_rope_ref,
    silu_and_mul=silu_and_mul_ref, store_kv=store_kv_ref, paged_attention=paged_attention_ref,
    varlen_attention=varlen_causal_attention_ref,
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
