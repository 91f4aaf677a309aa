"""One Gated DeltaNet decode step in one launch: causal conv update, delta-rule update, output and gated RMSNorm
(`gated_delta.gated_delta_decode_step_ref`'s contract) for batches where every sequence has at most one new row.

The unfused step is three kernels (kernels/causal_conv.py, the recurrent kernel of kernels/gated_delta_chunk.py,
kernels/gated_norm.py) with two round trips of the [T, C] conv output and the [T, Hv, Dv] delta-rule output through
memory between them; here one program per (value head h, sequence b) does all of it, and reads its fp32 state once.

Math for sequence b (its row r = query_start_loc[b], slot s), value head h of key head kh = h // (Hv / Hk), conv
kernel K, x the in_proj row [C] = q | k (Hk * Dk each) | v (Hv * Dv) channels, z [Hv * Dv], gates b | a [2 Hv]:
  y_c = round(silu(sum_{j<K-1} w[c, j] hist[s, c, j] + w[c, K-1] x_c))      for the q, k channels of kh, v of h
  hist[s, c] <- (hist[s, c, 1:], x_c)                                         (the last K-1 inputs)
  q, k = y_q / |y_q| * Dk^-0.5, y_k / |y_k|;  g = -exp(A_log[h]) softplus(a_h + dt_bias[h]);  beta = sigmoid(b_h)
  S = exp(g) S;  S <- S + k (beta (y_v - S^T k))^T;  o = round(S^T q)        (S = ssm[s, h] [Dk, Dv] fp32)
  out[r, h] = round(round(w_n * round(o / sqrt(mean(o^2) + eps))) * silu(z_h))
where round() rounds to the activation dtype at the points the unfused kernels store or round (the product with the
norm weight to the promoted dtype of the two), so the result is the unfused chain's within an ulp of the last
rounding. has_initial_state[b] False: hist and S read as zeros. A sequence with no row keeps its states, or, without
an initial state, has them zeroed (as the unfused kernels leave them).

Conv-state ownership: the Hv / Hk programs of one key head all read its q/k history, and one of them must write it
back, but only after every one has read it (a program of the group may run long after another has finished). Each
program counts itself in on a per-(sequence, key head) counter after its reads (a CTA barrier, then one thread's
acq_rel atomic at GPU scope, as kernels/splitk.py); the one that finds Hv / Hk - 1 there (the last reader) writes the
q/k history and sets the counter back to 0. The counters are splitk's persistent zeroed buffer: no allocation, no
host sync, CUDA-graph safe, every launch leaves them at 0. The v history of head h is its program's alone.

PDL (kernels/pdl.py): the step's inputs (query_start_loc, slots, flags) and this layer's state pools (written only
by this kernel within a step) are read before `gdc_wait`, the in_proj row after it: the 64 KiB state read of a
program overlaps the tail of the projection before it.

Shapes: mixed [T, C] (C = 2 Hk Dk + Hv Dv), z [T, Hv Dv], gates [T, 2 Hv] (unit last stride, row strides free: views
of the projection output), conv weight [C, K], A_log, dt_bias [Hv], norm weight [Dv]; conv_states [slots, C, K-1]
(any strides), ssm_states [slots, Hv, Dk, Dv] fp32 contiguous. Returns out [T, Hv Dv] in mixed's dtype; rows past
query_start_loc[B] are left unwritten.

Bytes per step and sequence, value head (Dk = Dv = 128, K = 4, bf16: Qwen3.5-27B): the state read and written once,
2 * Dk * Dv * 4 = 128 KiB; the v history (K-1) Dv read and written, the q/k history 2 (K-1) Dk read by each of the
group's programs (from L2 after the first) and written once; the input row's 2 Dk + Dv, z's Dv and the output's Dv
elements. At 48 value heads: 6 MiB of state and ~120 KiB of conv state per sequence and layer, against the unfused
chain's same state traffic plus (2 C + 3 Hv Dv) activation elements through memory and two more launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.gated_delta import gated_delta_decode_step_ref
from orinfer.kernels.gated_delta_chunk import log_decay
from orinfer.kernels.gemv import check_device
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.splitk import MAX_TILES, counters

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# The state tile [Dk, Dv] of a program lives in registers: 128 x 128 fp32 over 4 warps is 128 registers a thread
# (ptxas: 240-255 in all, no spills, so two programs an SM; tests/test_gated_delta_codegen.py). Larger heads take the
# unfused kernels (no Qwen3.5 size has them).
MAX_STATE_TILE = 128 * 128


@triton.jit
def _kept_history(conv, ch, mask, init, stride_cc, stride_ck, KW: tl.constexpr, BW: tl.constexpr):
    """The last K-2 columns of channels `ch`'s conv history, in the first K-2 of [n, BW] (what stays in the new
    history), in the state's dtype; zeros without an initial state."""
    e = tl.arange(0, BW)
    return tl.load(conv + ch[:, None] * stride_cc + (e + 1)[None, :] * stride_ck,
                   mask=mask[:, None] & (e < KW - 2)[None, :] & init, other=0.0)


@triton.jit
def _conv_silu(x, conv, ch, mask, init, w_ptr, stride_cc, stride_ck, KW: tl.constexpr):
    """silu of the causal conv at the new row x [n] of channels `ch`, over their history (zeros without an initial
    state), summed in the conv kernel's order in fp32, rounded to x's dtype (as the conv kernel stores it) and
    returned as fp32. One vector per history column: with a [n, K-1] tile here, the compiler gave q and k that
    tile's layout and moved the whole state tile into it and back through shared memory (two 64 KiB conversions)."""
    acc = tl.zeros_like(x.to(tl.float32))
    for j in tl.static_range(KW - 1):
        hist = tl.load(conv + ch * stride_cc + j * stride_ck, mask=mask & init, other=0.0).to(tl.float32)
        acc += hist * tl.load(w_ptr + ch * KW + j, mask=mask, other=0.0).to(tl.float32)
    acc += x.to(tl.float32) * tl.load(w_ptr + ch * KW + (KW - 1), mask=mask, other=0.0).to(tl.float32)
    return (acc / (1.0 + tl.exp(-acc))).to(x.dtype).to(tl.float32)


@triton.jit
def _store_history(conv, ch, mask, kept, x, stride_cc, stride_ck, KW: tl.constexpr, BW: tl.constexpr):
    """The new history of channels `ch`: the old one's last K-2 columns, then this row's inputs x."""
    e = tl.arange(0, BW)
    new = tl.where((e == KW - 2)[None, :], x.to(kept.dtype)[:, None], kept)
    tl.store(conv + ch[:, None] * stride_cc + e[None, :] * stride_ck, new,
             mask=mask[:, None] & (e < KW - 1)[None, :])


@triton.jit
def _zero_history(conv, ch, mask, stride_cc, stride_ck, KW: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr):
    """Zeros as the history of channels `ch` [BD]."""
    e = tl.arange(0, BW)
    tl.store(conv + ch[:, None] * stride_cc + e[None, :] * stride_ck, tl.zeros([BD, BW], dtype=conv.dtype.element_ty),
             mask=mask[:, None] & (e < KW - 1)[None, :])


@triton.jit
def _decode_step_kernel(x_ptr, z_ptr, gates_ptr, convw_ptr, alog_ptr, dtb_ptr, normw_ptr, qsl_ptr, slot_ptr,
                        init_ptr, conv_ptr, ssm_ptr, cnt_ptr, out_ptr, eps, scale,
                        stride_xt, stride_zt, stride_gt, stride_ot, stride_cs, stride_cc, stride_ck, stride_ss,
                        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, KW: tl.constexpr, BW: tl.constexpr, PROD_TY: tl.constexpr,
                        PDL: tl.constexpr):
    """One value head h of one sequence (grid (Hv, B)): the module docstring's math for its row."""
    GROUP: tl.constexpr = HV // HK
    h = tl.program_id(0)
    seq = tl.program_id(1)
    kh = h // GROUP
    row = tl.load(qsl_ptr + seq)
    init = tl.load(init_ptr + seq) != 0
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    d = tl.arange(0, BK)
    d_mask = d < DK
    dv = tl.arange(0, BV)
    v_mask = dv < DV
    state = ssm_ptr + slot * stride_ss + h * (DK * DV) + d[:, None] * DV + dv[None, :]
    s_mask = d_mask[:, None] & v_mask[None, :]
    conv = conv_ptr + slot * stride_cs
    q_ch = kh * DK + d
    k_ch = HK * DK + q_ch
    v_ch = 2 * HK * DK + h * DV + dv
    if tl.load(qsl_ptr + seq + 1) > row:
        # Before the wait: the state pools (only this kernel writes them in a step) and the step's inputs.
        S = tl.load(state, mask=s_mask & init, other=0.0)
        q_kept = _kept_history(conv, q_ch, d_mask, init, stride_cc, stride_ck, KW, BW)
        k_kept = _kept_history(conv, k_ch, d_mask, init, stride_cc, stride_ck, KW, BW)
        v_kept = _kept_history(conv, v_ch, v_mask, init, stride_cc, stride_ck, KW, BW)
        A_log = tl.load(alog_ptr + h).to(tl.float32)
        dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
        if PDL:  # the in_proj row is the previous kernel's output
            gdc_wait()
            gdc_launch_dependents()
        x_row = x_ptr + row.to(tl.int64) * stride_xt
        qx = tl.load(x_row + q_ch, mask=d_mask, other=0.0)
        kx = tl.load(x_row + k_ch, mask=d_mask, other=0.0)
        vx = tl.load(x_row + v_ch, mask=v_mask, other=0.0)
        q = _conv_silu(qx, conv, q_ch, d_mask, init, convw_ptr, stride_cc, stride_ck, KW)
        k = _conv_silu(kx, conv, k_ch, d_mask, init, convw_ptr, stride_cc, stride_ck, KW)
        v = _conv_silu(vx, conv, v_ch, v_mask, init, convw_ptr, stride_cc, stride_ck, KW)
        # The delta rule, as `_recurrent_kernel` computes one token.
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
        gate_row = gates_ptr + row.to(tl.int64) * stride_gt
        b = tl.load(gate_row + h).to(tl.float32)
        a = tl.load(gate_row + HV + h).to(tl.float32)
        S = S * tl.exp(log_decay(a, dt_bias, A_log))
        delta = (v - tl.sum(S * k[:, None], 0)) / (1.0 + tl.exp(-b))
        S = S + k[:, None] * delta[None, :]
        tl.store(state, S, mask=s_mask)
        o = tl.sum(S * q[:, None], 0).to(out_ptr.dtype.element_ty).to(tl.float32)
        # The gated RMSNorm, as `_gated_rms_norm_kernel` computes one row.
        o = tl.where(v_mask, o, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(o * o, 0) / DV + eps)
        y = (o * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (tl.load(normw_ptr + dv, mask=v_mask, other=0.0).to(tl.float32) * y).to(PROD_TY).to(tl.float32)
        zg = tl.load(z_ptr + row.to(tl.int64) * stride_zt + h * DV + dv, mask=v_mask, other=0.0).to(tl.float32)
        y = y * (zg / (1.0 + tl.exp(-zg)))
        tl.store(out_ptr + row.to(tl.int64) * stride_ot + h * DV + dv, y.to(out_ptr.dtype.element_ty), mask=v_mask)
        # The new conv histories, once every thread's reads of the old ones are done.
        tl.debug_barrier()
        _store_history(conv, v_ch, v_mask, v_kept, vx, stride_cc, stride_ck, KW, BW)
        if GROUP == 1:
            _store_history(conv, q_ch, d_mask, q_kept, qx, stride_cc, stride_ck, KW, BW)
            _store_history(conv, k_ch, d_mask, k_kept, kx, stride_cc, stride_ck, KW, BW)
        else:
            counter = cnt_ptr + seq * HK + kh
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == GROUP - 1:  # the key head's last reader
                _store_history(conv, q_ch, d_mask, q_kept, qx, stride_cc, stride_ck, KW, BW)
                _store_history(conv, k_ch, d_mask, k_kept, kx, stride_cc, stride_ck, KW, BW)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    elif tl.load(init_ptr + seq) == 0:
        # No row and no initial state: the slot's states become zeros, as the unfused kernels leave them (nobody
        # reads the old ones, so the group's first program may write the q/k history).
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        tl.store(state, tl.zeros([BK, BV], dtype=tl.float32), mask=s_mask)
        _zero_history(conv, v_ch, v_mask, stride_cc, stride_ck, KW, BV, BW)
        if h % GROUP == 0:
            _zero_history(conv, q_ch, d_mask, stride_cc, stride_ck, KW, BK, BW)
            _zero_history(conv, k_ch, d_mask, stride_cc, stride_ck, KW, BK, BW)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gated_delta_decode_step(mixed: torch.Tensor, z: torch.Tensor, gates: torch.Tensor, conv_weight: torch.Tensor,
                            A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            query_start_loc: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                            state_slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """`gated_delta_decode_step_ref`'s contract, for batches where every sequence has at most one row: mixed [T, C],
    z [T, Hv Dv], gates [T, 2 Hv] (b | a), conv_weight [C, K], A_log, dt_bias [Hv], norm_weight [Dv], eps,
    query_start_loc [B+1] int32, conv_states [slots, C, K-1], ssm_states [slots, Hv, Dk, Dv] fp32 (both updated in
    place), state_slots [B], has_initial_state [B] -> out [T, Hv Dv] in mixed's dtype. Head counts and sizes come
    from the shapes (Hv from gates, Dk, Dv from ssm_states, Hk from C).

    Kernel: `_decode_step_kernel`, grid (Hv, B) from the shapes alone (no host sync: CUDA-graph capturable).
    Heads too large for one register tile, or more (sequence, key head) pairs than counters, take the unfused
    kernels (the same result).
    """
    check_device(mixed)
    tokens, channels = mixed.shape
    num_seqs = state_slots.shape[0]
    v_heads, dk, dv = ssm_states.shape[1], ssm_states.shape[2], ssm_states.shape[3]
    width = conv_weight.shape[-1]
    key_dim2 = channels - v_heads * dv  # 2 Hk Dk
    k_heads = key_dim2 // (2 * dk) if dk else 0
    if (gates.shape != (tokens, 2 * v_heads) or z.shape != (tokens, v_heads * dv) or k_heads == 0
            or key_dim2 != 2 * k_heads * dk or v_heads % k_heads or conv_weight.shape != (channels, width)
            or width < 2 or conv_states.shape[1:] != (channels, width - 1) or A_log.shape != (v_heads,)
            or dt_bias.shape != (v_heads,) or norm_weight.shape != (dv,)
            or query_start_loc.shape != (num_seqs + 1,) or has_initial_state.shape != (num_seqs,)):
        raise ValueError(f"gated_delta_decode_step: mixed {tuple(mixed.shape)}, z {tuple(z.shape)}, gates "
                         f"{tuple(gates.shape)}, conv_weight {tuple(conv_weight.shape)}, conv_states "
                         f"{tuple(conv_states.shape)}, ssm_states {tuple(ssm_states.shape)}, A_log "
                         f"{tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)}, norm_weight "
                         f"{tuple(norm_weight.shape)}, query_start_loc {tuple(query_start_loc.shape)}, "
                         f"has_initial_state {tuple(has_initial_state.shape)} for {num_seqs} sequences do not match")
    if ssm_states.dtype != torch.float32 or not ssm_states.is_contiguous():
        raise ValueError(f"gated_delta_decode_step: ssm_states must be contiguous fp32, got {ssm_states.dtype} "
                         f"with strides {ssm_states.stride()}")
    block_k, block_v = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    prod = torch.promote_types(norm_weight.dtype, mixed.dtype)
    if (block_k * block_v > MAX_STATE_TILE or num_seqs * k_heads > MAX_TILES or mixed.dtype not in _TL_DTYPES
            or prod not in _TL_DTYPES):
        from orinfer.kernels.causal_conv import causal_conv1d
        from orinfer.kernels.gated_delta_chunk import gated_delta_rule
        from orinfer.kernels.gated_norm import gated_rms_norm

        return gated_delta_decode_step_ref(mixed, z, gates, conv_weight, A_log, dt_bias, norm_weight, eps,
                                           query_start_loc, conv_states, ssm_states, state_slots, has_initial_state,
                                           conv=causal_conv1d, rule=gated_delta_rule, norm=gated_rms_norm)
    mixed, z, gates = _unit_last(mixed), _unit_last(z), _unit_last(gates)
    conv_weight, norm_weight = conv_weight.contiguous(), norm_weight.contiguous()
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    out = torch.empty(tokens, v_heads * dv, dtype=mixed.dtype, device=mixed.device)
    if num_seqs == 0:
        return out
    pdl = use_pdl(mixed)
    _decode_step_kernel[(v_heads, num_seqs)](
        mixed, z, gates, conv_weight, A_log, dt_bias, norm_weight, query_start_loc, state_slots, has_initial_state,
        conv_states, ssm_states, counters(mixed.device), out, eps, dk ** -0.5,
        mixed.stride(0), z.stride(0), gates.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1),
        conv_states.stride(2), ssm_states.stride(0),
        HK=k_heads, HV=v_heads, DK=dk, DV=dv, BK=block_k, BV=block_v, KW=width,
        BW=triton.next_power_of_2(width - 1), PROD_TY=_TL_DTYPES[prod], PDL=pdl,
        num_warps=max(1, min(4, block_k * block_v // 4096)), launch_pdl=pdl)
    return out
