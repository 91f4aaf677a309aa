"""One Gated DeltaNet step in one launch: causal conv update, delta-rule update, output and gated RMSNorm
(`gated_delta.gated_delta_decode_step_ref`'s contract) for batches where every sequence has a few new rows (decode:
one; a speculative verify step: 1 + k), and the same without the output (`gated_delta_advance_ref`: the state
rollback's replay of the accepted rows).

The unfused step is three kernels (kernels/causal_conv.py, the recurrent kernel of kernels/gated_delta_chunk.py,
kernels/gated_norm.py) with two round trips of the [T, C] conv output and the [T, Hv, Dv] delta-rule output through
memory between them; here one program per (value head h, sequence b) does all of it, and reads its fp32 state once.

Math for sequence b (rows r_0 .. r_{n-1} from query_start_loc, slot s), value head h of key head kh = h // (Hv / Hk),
conv kernel K, x the in_proj rows [n, C] = q | k (Hk * Dk each) | v (Hv * Dv) channels, z [n, Hv * Dv], gates b | a
[n, 2 Hv]; window_c = (hist[s, c, 0 .. K-2], x_{r_0, c}, .., x_{r_{n-1}, c}) (K-1+n inputs), for row j in order:
  y_c = round(silu(sum_{i<K} w[c, i] window_c[j + i]))                      for the q, k channels of kh, v of h
  q, k = y_q / |y_q| * Dk^-0.5, y_k / |y_k|;  g = -exp(A_log[h]) softplus(a_h + dt_bias[h]);  beta = sigmoid(b_h)
  S = exp(g) S;  S <- S + k (beta (y_v - S^T k))^T;  o = round(S^T q)        (S = ssm[s, h] [Dk, Dv] fp32)
  out[r_j, h] = round(round(w_n * round(o / sqrt(mean(o^2) + eps))) * silu(z_h))
then hist[s, c] <- window_c's last K-1 inputs (part of the old history when n < K-1). round() rounds to the
activation dtype at the points the unfused kernels store or round (the product with the norm weight to the promoted
dtype of the two), so the result is the unfused chain's within an ulp of the last rounding. has_initial_state[b]
False: hist and S read as zeros. A sequence with no row keeps its states, or, without an initial state, has them
zeroed (as the unfused kernels leave them). The advance variant (OUTPUT False) skips q, o, z and the norm.

Two kernels, one math: `_decode_step_kernel` for one row a sequence (its conv history read before the PDL wait,
beside the state) and `_rows_kernel` (kernels/gated_delta_rows.py) for any count (a row loop with the state tile in
registers, each chunk of rows prepared at once before it). The one-row kernel stays separate so decode pays nothing
for the loop; `gated_delta_decode_step` picks by the host-known bound on rows (and the rows kernel's tile height).

Conv-state ownership: the Hv / Hk programs of one key head all read its q/k history, and one of them must write it
back, but only after every one has read it (a program of the group may run long after another has finished). Each
program counts itself in on a per-(sequence, key head) counter after its reads (a CTA barrier, then one thread's
acq_rel atomic at GPU scope, as kernels/splitk.py); the one that finds Hv / Hk - 1 there (the last reader) writes the
q/k history and sets the counter back to 0. The counters are splitk's persistent zeroed buffer: no allocation, no
host sync, CUDA-graph safe, every launch leaves them at 0. The v history of head h is its program's alone.

PDL (kernels/pdl.py): the step's inputs (query_start_loc, slots, flags) and this layer's state pools (written only
by this kernel within a step) are read before `gdc_wait`, the in_proj rows after it: the 64 KiB state read of a
program overlaps the tail of the projection before it.

Shapes: mixed [T, C] (C = 2 Hk Dk + Hv Dv), z [T, Hv Dv], gates [T, 2 Hv] (unit last stride, row strides free: views
of the projection output), conv weight [C, K], A_log, dt_bias [Hv], norm weight [Dv]; conv_states [slots, C, K-1]
(any strides), ssm_states [slots, Hv, Dk, Dv] fp32 contiguous. Returns out [T, Hv Dv] in mixed's dtype; rows past
query_start_loc[B] are left unwritten.

Bytes per step and sequence, value head (Dk = Dv = 128, K = 4, bf16: Qwen3.5-27B): the state read and written once,
2 * Dk * Dv * 4 = 128 KiB; the v history (K-1) Dv read and written, the q/k history 2 (K-1) Dk read by each of the
group's programs (from L2 after the first) and written once; per row the input's 2 Dk + Dv, z's Dv and the output's
Dv elements. At 48 value heads: 6 MiB of state and ~120 KiB of conv state per sequence and layer, against the
unfused chain's same state traffic plus (2 C + 3 Hv Dv) activation elements a row through memory and two (advance:
one) more launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.gated_delta import gated_delta_advance_ref, gated_delta_decode_step_ref
from orinfer.kernels.gated_delta_chunk import log_decay
from orinfer.kernels.gated_delta_conv_window import (conv_silu, kept_history, program, with_row, write_histories,
                                                     zero_states)
from orinfer.kernels.gated_delta_rows import _rows_kernel
from orinfer.kernels.gemv import TL_DTYPES, check_device
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.splitk import MAX_TILES, counters

# The state tile [Dk, Dv] of a program lives in registers: 128 x 128 fp32 over 4 warps is 128 registers a thread
# (ptxas: 240-255 in all, no spills, so two programs an SM; tests/test_gated_delta_codegen.py). Larger heads take the
# unfused kernels (no Qwen3.5 size has them).
MAX_STATE_TILE = 128 * 128
# The most rows `_rows_kernel` prepares at once (its tiles of q, k, v, z and the output, R rows each): a k = 3 verify
# step's 4 rows, or the rollback's 1 + a accepted ones, in one chunk. At 4, 27B's heads take 246 registers (sm_90,
# bf16: no spills); each tile height is a kernel of its own, compiled at start-up (engine/warmup.py's prompt rows and
# graphs, StateRollback.warm_up).
ROWS_TILE = 4


@triton.jit
def _delta_rule(S, k, v, b, a, A_log, dt_bias):
    """One token of the delta rule on the state tile S [Dk, Dv], as `_recurrent_kernel` computes it (k raw)."""
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    S = S * tl.exp(log_decay(a, dt_bias, A_log))
    delta = (v - tl.sum(S * k[:, None], 0)) / (1.0 + tl.exp(-b))
    return S + k[:, None] * delta[None, :]


@triton.jit
def _norm_output(S, q, scale, z_row, normw_ptr, out_row, dv, v_mask, eps, DV: tl.constexpr, PROD_TY: tl.constexpr):
    """o = S^T q (q raw) rounded as the recurrent kernel stores it, then the gated RMSNorm as
    `_gated_rms_norm_kernel` computes one row, stored at out_row."""
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
    o = tl.sum(S * q[:, None], 0).to(out_row.dtype.element_ty).to(tl.float32)
    o = tl.where(v_mask, o, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, 0) / DV + eps)
    y = (o * rstd).to(out_row.dtype.element_ty).to(tl.float32)
    y = (tl.load(normw_ptr + dv, mask=v_mask, other=0.0).to(tl.float32) * y).to(PROD_TY).to(tl.float32)
    zg = tl.load(z_row + dv, mask=v_mask, other=0.0).to(tl.float32)
    y = y * (zg / (1.0 + tl.exp(-zg)))
    tl.store(out_row + dv, y.to(out_row.dtype.element_ty), mask=v_mask)


@triton.jit
def _decode_step_kernel(x_ptr, z_ptr, gates_ptr, convw_ptr, alog_ptr, dtb_ptr, normw_ptr, qsl_ptr, slot_ptr,
                        init_ptr, conv_ptr, ssm_ptr, cnt_ptr, out_ptr, eps, scale,
                        stride_xt, stride_zt, stride_gt, stride_ot, stride_cs, stride_cc, stride_ck, stride_ss,
                        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, KW: tl.constexpr, BW: tl.constexpr, PROD_TY: tl.constexpr,
                        PDL: tl.constexpr):
    """One value head h of one sequence of at most one row (grid (Hv, B)): the module docstring's math for it."""
    h, seq, kh, row, end, init, state, s_mask, conv, q_ch, k_ch, v_ch, d_mask, v_mask, dv = program(
        qsl_ptr, slot_ptr, init_ptr, conv_ptr, ssm_ptr, stride_cs, stride_ss, HK, HV, DK, DV, BK, BV)
    if end > row:
        # Before the wait: the state pools (only this kernel writes them in a step) and the step's inputs.
        S = tl.load(state, mask=s_mask & init, other=0.0)
        q_kept = kept_history(conv, q_ch, d_mask, init, stride_cc, stride_ck, KW, BW)
        k_kept = kept_history(conv, k_ch, d_mask, init, stride_cc, stride_ck, KW, BW)
        v_kept = kept_history(conv, v_ch, v_mask, init, stride_cc, stride_ck, KW, BW)
        A_log = tl.load(alog_ptr + h).to(tl.float32)
        dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
        if PDL:  # the in_proj row is the previous kernel's output
            gdc_wait()
            gdc_launch_dependents()
        x_row = x_ptr + row.to(tl.int64) * stride_xt
        qx = tl.load(x_row + q_ch, mask=d_mask, other=0.0)
        kx = tl.load(x_row + k_ch, mask=d_mask, other=0.0)
        vx = tl.load(x_row + v_ch, mask=v_mask, other=0.0)
        q = conv_silu(qx, conv, q_ch, d_mask, init, convw_ptr, stride_cc, stride_ck, KW)
        k = conv_silu(kx, conv, k_ch, d_mask, init, convw_ptr, stride_cc, stride_ck, KW)
        v = conv_silu(vx, conv, v_ch, v_mask, init, convw_ptr, stride_cc, stride_ck, KW)
        gate_row = gates_ptr + row.to(tl.int64) * stride_gt
        S = _delta_rule(S, k, v, tl.load(gate_row + h).to(tl.float32), tl.load(gate_row + HV + h).to(tl.float32),
                        A_log, dt_bias)
        tl.store(state, S, mask=s_mask)
        _norm_output(S, q, scale, z_ptr + row.to(tl.int64) * stride_zt + h * DV, normw_ptr,
                     out_ptr + row.to(tl.int64) * stride_ot + h * DV, dv, v_mask, eps, DV, PROD_TY)
        write_histories(conv, q_ch, k_ch, v_ch, d_mask, v_mask, with_row(q_kept, qx, KW, BW),
                         with_row(k_kept, kx, KW, BW), with_row(v_kept, vx, KW, BW), cnt_ptr + seq * HK + kh,
                         stride_cc, stride_ck, HV // HK, KW, BW)
    elif tl.load(init_ptr + seq) == 0:
        zero_states(state, s_mask, conv, q_ch, k_ch, v_ch, d_mask, v_mask, h % (HV // HK) == 0, stride_cc,
                     stride_ck, KW, BK, BV, BW, PDL)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _heads(name: str, mixed: torch.Tensor, gates: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
           dt_bias: torch.Tensor, query_start_loc: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
           state_slots: torch.Tensor, has_initial_state: torch.Tensor, z: torch.Tensor | None = None,
           norm_weight: torch.Tensor | None = None) -> tuple[int, int, int, int, int]:
    """(Hk, Hv, Dk, Dv, K) from the shapes, which are checked (z and norm_weight when given); ValueError naming
    `name` otherwise."""
    tokens, channels = mixed.shape
    num_seqs = state_slots.shape[0]
    v_heads, dk, dv = ssm_states.shape[1], ssm_states.shape[2], ssm_states.shape[3]
    width = conv_weight.shape[-1]
    key_dim2 = channels - v_heads * dv  # 2 Hk Dk
    k_heads = key_dim2 // (2 * dk) if dk else 0
    if (gates.shape != (tokens, 2 * v_heads) or (z is not None and z.shape != (tokens, v_heads * dv))
            or k_heads == 0 or key_dim2 != 2 * k_heads * dk or v_heads % k_heads
            or conv_weight.shape != (channels, width) or width < 2 or conv_states.shape[1:] != (channels, width - 1)
            or A_log.shape != (v_heads,) or dt_bias.shape != (v_heads,)
            or (norm_weight is not None and norm_weight.shape != (dv,))
            or query_start_loc.shape != (num_seqs + 1,) or has_initial_state.shape != (num_seqs,)):
        shapes = dict(mixed=mixed, z=z, gates=gates, conv_weight=conv_weight, conv_states=conv_states,
                      ssm_states=ssm_states, A_log=A_log, dt_bias=dt_bias, norm_weight=norm_weight,
                      query_start_loc=query_start_loc, has_initial_state=has_initial_state)
        listed = ", ".join(f"{k} {tuple(v.shape)}" for k, v in shapes.items() if v is not None)
        raise ValueError(f"{name}: {listed} for {num_seqs} sequences do not match")
    if ssm_states.dtype != torch.float32 or not ssm_states.is_contiguous():
        raise ValueError(f"{name}: ssm_states must be contiguous fp32, got {ssm_states.dtype} with strides "
                         f"{ssm_states.stride()}")
    return k_heads, v_heads, dk, dv, width


def _blocks(dk: int, dv: int) -> tuple[int, int]:
    return max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))


def rows_tile(max_rows_per_seq: int | None) -> int:
    """R, the rows `_rows_kernel` prepares at once (a chunk): the next power of two of the host-known bound on rows a
    sequence, at most ROWS_TILE (None: unknown, ROWS_TILE); more rows take several chunks."""
    if max_rows_per_seq is None:
        return ROWS_TILE
    return min(ROWS_TILE, triton.next_power_of_2(max(1, max_rows_per_seq)))


def _fuses(mixed: torch.Tensor, num_seqs: int, k_heads: int, dk: int, dv: int, prod: torch.dtype) -> bool:
    """Whether the fused kernels take the batch: the state tile fits a program's registers, a counter for each
    (sequence, key head), dtypes Triton names."""
    block_k, block_v = _blocks(dk, dv)
    return (block_k * block_v <= MAX_STATE_TILE and num_seqs * k_heads <= MAX_TILES and mixed.dtype in TL_DTYPES
            and prod in TL_DTYPES)


def _launch(kernel, mixed, z, gates, conv_weight, A_log, dt_bias, norm_weight, eps, query_start_loc, conv_states,
            ssm_states, state_slots, has_initial_state, out, heads: tuple[int, int, int, int, int],
            prod: torch.dtype, **flags) -> None:
    """Launches one of the kernels over grid (Hv, B) from the shapes alone (no host sync: CUDA-graph capturable)."""
    k_heads, v_heads, dk, dv, width = heads
    block_k, block_v = _blocks(dk, dv)
    pdl = use_pdl(mixed)
    kernel[(v_heads, state_slots.shape[0])](
        mixed, z, gates, conv_weight, A_log, dt_bias, norm_weight, query_start_loc, state_slots, has_initial_state,
        conv_states, ssm_states, counters(mixed.device), out, eps, dk ** -0.5,
        mixed.stride(0), z.stride(0), gates.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1),
        conv_states.stride(2), ssm_states.stride(0),
        HK=k_heads, HV=v_heads, DK=dk, DV=dv, BK=block_k, BV=block_v, KW=width,
        BW=triton.next_power_of_2(width - 1), PROD_TY=TL_DTYPES[prod], PDL=pdl, **flags,
        num_warps=max(1, min(4, block_k * block_v // 4096)), launch_pdl=pdl)


def gated_delta_decode_step(mixed: torch.Tensor, z: torch.Tensor, gates: torch.Tensor, conv_weight: torch.Tensor,
                            A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            query_start_loc: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                            state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                            max_rows_per_seq: int | None = 1) -> torch.Tensor:
    """`gated_delta_decode_step_ref`'s contract: mixed [T, C], z [T, Hv Dv], gates [T, 2 Hv] (b | a), conv_weight
    [C, K], A_log, dt_bias [Hv], norm_weight [Dv], eps, query_start_loc [B+1] int32, conv_states [slots, C, K-1],
    ssm_states [slots, Hv, Dk, Dv] fp32 (both updated in place), state_slots [B], has_initial_state [B] -> out
    [T, Hv Dv] in mixed's dtype. Head counts and sizes come from the shapes (Hv from gates, Dk, Dv from ssm_states,
    Hk from C). `max_rows_per_seq`: the most rows any sequence has (None: unknown).

    Kernels: `_decode_step_kernel` when every sequence has at most one row, else `_rows_kernel` (any count; the
    model keeps it to a few: gated_delta.FUSED_STEP_MAX_ROWS) in chunks of rows_tile(max_rows_per_seq) rows. Heads
    too large for one register tile, or more (sequence, key head) pairs than counters, take the unfused kernels (the
    same result).
    """
    check_device(mixed)
    heads = _heads("gated_delta_decode_step", mixed, gates, conv_weight, A_log, dt_bias, query_start_loc,
                   conv_states, ssm_states, state_slots, has_initial_state, z, norm_weight)
    num_seqs = state_slots.shape[0]
    prod = torch.promote_types(norm_weight.dtype, mixed.dtype)
    if not _fuses(mixed, num_seqs, heads[0], heads[2], heads[3], prod):
        from orinfer.kernels.causal_conv import causal_conv1d
        from orinfer.kernels.gated_delta_chunk import gated_delta_rule
        from orinfer.kernels.gated_norm import gated_rms_norm

        return gated_delta_decode_step_ref(mixed, z, gates, conv_weight, A_log, dt_bias, norm_weight, eps,
                                           query_start_loc, conv_states, ssm_states, state_slots, has_initial_state,
                                           conv=causal_conv1d, rule=gated_delta_rule, norm=gated_rms_norm)
    mixed, z, gates = _unit_last(mixed), _unit_last(z), _unit_last(gates)
    out = torch.empty(mixed.shape[0], heads[1] * heads[3], dtype=mixed.dtype, device=mixed.device)
    if num_seqs == 0:
        return out
    one_row = max_rows_per_seq is not None and max_rows_per_seq <= 1
    flags = {} if one_row else {"OUTPUT": True, "R": rows_tile(max_rows_per_seq)}
    _launch(_decode_step_kernel if one_row else _rows_kernel, mixed, z, gates, conv_weight.contiguous(),
            A_log.contiguous(), dt_bias.contiguous(), norm_weight.contiguous(), eps, query_start_loc, conv_states,
            ssm_states, state_slots, has_initial_state, out, heads, prod, **flags)
    return out


def gated_delta_advance(mixed: torch.Tensor, gates: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                        dt_bias: torch.Tensor, query_start_loc: torch.Tensor, conv_states: torch.Tensor,
                        ssm_states: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                        max_rows_per_seq: int | None = None) -> None:
    """`gated_delta_advance_ref`'s contract (the decode step's state updates, no output): mixed [T, C], gates
    [T, 2 Hv] (b | a), conv_weight [C, K], A_log, dt_bias [Hv], query_start_loc [B+1] int32, conv_states
    [slots, C, K-1] and ssm_states [slots, Hv, Dk, Dv] fp32 updated in place, state_slots [B], has_initial_state [B];
    `max_rows_per_seq` the most rows any sequence has (None: unknown).

    Kernel: `_rows_kernel` with OUTPUT False in chunks of rows_tile(max_rows_per_seq) rows, grid (Hv, B), one launch
    where the unfused chain takes two (the conv, then the recurrent kernel). Heads that cannot fuse take those two
    (the same result).
    """
    check_device(mixed)
    heads = _heads("gated_delta_advance", mixed, gates, conv_weight, A_log, dt_bias, query_start_loc, conv_states,
                   ssm_states, state_slots, has_initial_state)
    num_seqs = state_slots.shape[0]
    if not _fuses(mixed, num_seqs, heads[0], heads[2], heads[3], mixed.dtype):
        from orinfer.kernels.causal_conv import causal_conv1d
        from orinfer.kernels.gated_delta_chunk import gated_delta_rule

        gated_delta_advance_ref(mixed, gates, conv_weight, A_log, dt_bias, query_start_loc, conv_states, ssm_states,
                                state_slots, has_initial_state, conv=causal_conv1d, rule=gated_delta_rule)
        return
    if num_seqs == 0:
        return
    mixed, gates = _unit_last(mixed), _unit_last(gates)
    # No z, norm weight or output: the kernel compiles them out (OUTPUT False); any tensors fill their places.
    _launch(_rows_kernel, mixed, mixed, gates, conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous(),
            A_log, 0.0, query_start_loc, conv_states, ssm_states, state_slots, has_initial_state, mixed, heads,
            mixed.dtype, OUTPUT=False, R=rows_tile(max_rows_per_seq))
