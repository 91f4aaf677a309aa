"""Gated DeltaNet (the linear-attention layers of Qwen3.5/3.6/3.8): the causal depthwise conv over q/k/v, the gated
delta rule over a per-sequence fp32 state, and the gated RMSNorm of its output.

Batch layout: the flat varlen batch of the engine. Sequence b owns the rows query_start_loc[b]:query_start_loc[b+1]
of x (its newest tokens, any count >= 0) and the state slot state_slots[b] of the layer's state pools:
  conv_states [slots, C, K-1]            the last K-1 conv inputs before the sequence's first new row (model dtype)
  ssm_states  [slots, Hv, Dk, Dv] fp32    the delta-rule state S (keys along Dk, values along Dv)
has_initial_state[b] False means the sequence starts here (its first token is among the rows): its states are read as
zeros, whatever the slot holds. Both pools are rewritten in place with each sequence's state after its last row.

Math per value head h (key head h // (Hv / Hk)), token t, with q, k L2-normalised and q scaled by Dk^-0.5:
  g_t = -exp(A_log[h]) * softplus(a_t + dt_bias[h]),  beta_t = sigmoid(b_t)
  S <- exp(g_t) * S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
The references below loop over tokens in fp32; they are the contract for the Triton kernels.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


# The most rows a sequence may have for a model to take the one-launch step (`gated_delta_decode_step_ref`'s contract,
# fused by kernels/gated_delta_decode.py) rather than the three ops: the fused kernels walk a sequence's rows one
# after another in Hv x B programs, where the unfused recurrent kernel splits each head's columns over 8 programs and
# the chunked kernels parallelise a prompt's rows. 16 covers speculative verify steps (1 + k rows) and the mixed-step
# CUDA graphs of 8 and 16 rows.
FUSED_STEP_MAX_ROWS = 16


def _spans(query_start_loc: torch.Tensor) -> list[tuple[int, int]]:
    starts = query_start_loc.tolist()
    return list(zip(starts[:-1], starts[1:]))


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, query_start_loc: torch.Tensor,
                      conv_states: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor
                      ) -> torch.Tensor:
    """silu(depthwise causal conv) of x [T, C] with weight [C, K] (no bias), each sequence continuing from its conv
    state; returns [T, C] in x's dtype and leaves in each slot the sequence's last K-1 inputs (state included, so a
    sequence shorter than K-1 rows keeps part of its old state). Computed in fp32 from x's values."""
    out = torch.empty_like(x)
    width = weight.shape[1]
    w = weight.float()
    for b, (begin, end) in enumerate(_spans(query_start_loc)):
        slot = int(state_slots[b])
        if bool(has_initial_state[b]):
            history = conv_states[slot].float()                            # [C, K-1]
        else:
            history = torch.zeros(x.shape[1], width - 1, dtype=torch.float32, device=x.device)
        window = torch.cat([history, x[begin:end].float().t()], dim=1)     # [C, K-1+n]
        if end > begin:
            conv = F.conv1d(window[None], w[:, None, :], groups=x.shape[1])[0]  # [C, n]
            out[begin:end] = F.silu(conv).t().to(x.dtype)
        conv_states[slot] = window[:, window.shape[1] - (width - 1):].to(conv_states.dtype)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, query_start_loc: torch.Tensor,
                         ssm_states: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                         decode: bool | None = None, max_rows_per_seq: int | None = None) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv] (the gate projections), A_log, dt_bias [Hv] -> o [T, Hv, Dv] in
    v's dtype; each sequence's final state goes to its slot of ssm_states [slots, Hv, Dk, Dv] (fp32). `decode` (force
    the token-loop path) and `max_rows_per_seq` (the most rows any sequence has, known on the host) pick a kernel's
    path; the reference ignores them."""
    out = torch.empty_like(v)
    group = v.shape[1] // k.shape[1]
    qf = _l2norm(q.float()).repeat_interleave(group, dim=1) * q.shape[-1] ** -0.5
    kf = _l2norm(k.float()).repeat_interleave(group, dim=1)
    vf = v.float()
    decay = torch.exp(-A_log.float().exp() * F.softplus(a.float() + dt_bias.float()))  # [T, Hv]
    beta = torch.sigmoid(b.float())
    for seq, (begin, end) in enumerate(_spans(query_start_loc)):
        slot = int(state_slots[seq])
        state = ssm_states[slot].float().clone() if bool(has_initial_state[seq]) else torch.zeros_like(
            ssm_states[slot], dtype=torch.float32)
        for t in range(begin, end):
            state = state * decay[t][:, None, None]
            predicted = torch.einsum("hkv,hk->hv", state, kf[t])
            delta = (vf[t] - predicted) * beta[t][:, None]
            state = state + kf[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, qf[t]).to(v.dtype)
        ssm_states[slot] = state
    return out


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate) over the last dim of x, gate [..., D] (HF's Qwen3NextRMSNormGated rounding:
    the normed row in x's dtype times the weight, then the gate in fp32)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def gated_delta_decode_step_ref(mixed: torch.Tensor, z: torch.Tensor, gates: torch.Tensor, conv_weight: torch.Tensor,
                                A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                query_start_loc: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                                state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                                max_rows_per_seq: int | None = None, *, conv: Callable = causal_conv1d_ref,
                                rule: Callable = gated_delta_rule_ref, norm: Callable = gated_rms_norm_ref
                                ) -> torch.Tensor:
    """A whole Gated DeltaNet step after in_proj, for sequences of a few rows each (decode: one; speculative verify:
    1 + k): the conv over mixed [T, C] (q | k | v channels) -> the delta rule -> the gated RMSNorm of the output with
    z [T, Hv Dv]; gates [T, 2 Hv] are b | a; conv_weight [C, K], norm_weight [Dv]; both state pools updated in place.
    Returns [T, Hv Dv] in mixed's dtype. Head sizes come from the shapes: Hv from gates, Dk and Dv from ssm_states
    [slots, Hv, Dk, Dv], Hk from C = 2 Hk Dk + Hv Dv. `max_rows_per_seq` (the most rows a sequence has, known on
    the host; None: unknown) lets a kernel pick its path; the reference takes any rows. `conv`, `rule` and `norm` are
    the three ops composed (the references by default: this is the contract of kernels/gated_delta_decode.py's fused
    kernels; they pass their unfused kernels when they cannot fuse)."""
    tokens, heads, dv = mixed.shape[0], ssm_states.shape[1], ssm_states.shape[3]
    o = _conv_and_rule(mixed, gates, conv_weight, A_log, dt_bias, query_start_loc, conv_states, ssm_states,
                       state_slots, has_initial_state, conv, rule)
    out = norm(o.reshape(tokens * heads, dv), z.reshape(tokens * heads, dv), norm_weight, eps)
    return out.reshape(tokens, heads * dv)


def gated_delta_advance_ref(mixed: torch.Tensor, gates: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                            dt_bias: torch.Tensor, query_start_loc: torch.Tensor, conv_states: torch.Tensor,
                            ssm_states: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                            max_rows_per_seq: int | None = None, *, conv: Callable = causal_conv1d_ref,
                            rule: Callable = gated_delta_rule_ref) -> None:
    """`gated_delta_decode_step_ref`'s state updates without its output (no z, no norm): each sequence's conv and
    delta-rule states advanced over its rows of conv inputs mixed [T, C] and gate inputs gates [T, 2 Hv] (b | a),
    in place. The speculative state rollback replays a sequence's accepted rows so (engine/state_rollback.py).
    `max_rows_per_seq` as the step's (a kernel's hint; the reference takes any rows)."""
    _conv_and_rule(mixed, gates, conv_weight, A_log, dt_bias, query_start_loc, conv_states, ssm_states, state_slots,
                   has_initial_state, conv, rule)


def _conv_and_rule(mixed: torch.Tensor, gates: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor, query_start_loc: torch.Tensor, conv_states: torch.Tensor,
                   ssm_states: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                   conv: Callable, rule: Callable) -> torch.Tensor:
    """The conv, then the delta rule's token loop (`decode=True`: the recurrent kernel, as decode and verify rows
    run it) -> o [T, Hv, Dv]; both pools updated."""
    tokens = mixed.shape[0]
    heads, dk, dv = ssm_states.shape[1], ssm_states.shape[2], ssm_states.shape[3]
    key_dim = (mixed.shape[1] - heads * dv) // 2
    b, a = gates.split([heads, heads], dim=-1)
    x = conv(mixed, conv_weight, query_start_loc, conv_states, state_slots, has_initial_state)
    q, k, v = x.split([key_dim, key_dim, heads * dv], dim=-1)
    return rule(q.reshape(tokens, -1, dk), k.reshape(tokens, -1, dk), v.reshape(tokens, heads, dv), a, b, A_log,
                dt_bias, query_start_loc, ssm_states, state_slots, has_initial_state, decode=True)
