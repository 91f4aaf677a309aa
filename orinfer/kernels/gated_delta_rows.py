"""The fused Gated DeltaNet step's row loop: `_rows_kernel`, one program per (value head h, sequence) over any number
of rows a sequence (speculative verify steps, the state rollback's replay, short prompts). kernels/gated_delta_decode.py
launches it and documents the math (y, q, k, g, beta, S, o, out per row), the conv-state ownership and the PDL
handshake; the one-row kernel there does the same for decode rows without a loop.

Row j's state update needs row j-1's, but most of a row's work does not touch the state. So the rows go in chunks of
R (`gated_delta_decode.rows_tile`: the next power of two of the host's rows bound, at most 4: a k = 3 verify step's
rows or the rollback's 1 + a in one chunk, longer sequences in several), and per chunk c (rows c .. c+R-1, those
past the sequence's n masked):
  first, for the R rows at once:  K_c [R, Dk], Q_c [R, Dk] the rows' k and q (conv over the window, silu, rounding,
      L2 norm, q's Dk^-0.5), V_c [Dv, R] their y_v, D_c [R] = exp(g), E_c [R] = 1 + exp(-b) = 1 / beta, Z_c [R, Dv]
      and the norm weight;
  then the serial loop, row j after row j-1:  S = D_c[j] S;  S <- S + K_c[j] ((V_c[:, j] - S^T K_c[j]) / E_c[j])^T;
      O_c[j] = round(S^T Q_c[j]);
  last, the gated RMSNorm of O_c's rows at once and one store of out[c .. c+R-1, h] [R, Dv].
A row is picked from a tile by a sum with -0.0 along R (exact to the bit), and every rounding is the per-row math's
at the same point: the results are those of a loop doing each row's whole work in turn (bit for bit in the
interpreter; tests/test_gated_delta_rows.py).

Why. In such a loop each row waited on three dependent rounds of loads from L2 (its k and v windows and gates; its q
window; z and the norm weight) between 20 barriers: on the H200 a 4-row step took 16.5 us a layer against 5.4 for
one row (~3.7 us a row, all latency: 48 programs at batch 1). Now the serial loop touches no global memory
(tests/test_gated_delta_codegen.py checks): per row three layout conversions (k and q into the state tile's row
slice, v into its column slice), the two reductions of S over Dk and the state's elementwise work, ~700 sm_90
instructions and 12 barriers against ~1440, 20 and 40 global loads; a chunk's preparation, ~1100 instructions, issues
its 64 loads a thread together. Layouts: the conv tiles are loaded a row or a tap at a time ([1, D] or [D, 1]
pointers), which gives every load of a tile one layout (no conversion in the preparation), and V_c is held
channel-major (a vector picked from an [R, Dv] tile handed its layout to the state tile: two 64 KiB conversions
through shared memory and spills). sm_90 at Qwen3.5-27B's heads, bf16: 246 registers at R = 4, no spills. Measured
on the H200 (NOTES run 392): 4 rows 11.29 us a layer (was 16.75), the advance 7.86 (10.85); one row unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from orinfer.kernels.gated_delta_chunk import log_decay
from orinfer.kernels.gated_delta_conv_window import program, rows_conv, window_tail, write_histories, zero_states
from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _l2_rows(x):
    """Each row of the tile x [R, n] over its L2 norm, as gated_delta_decode's `_delta_rule` normalises one."""
    return x / tl.sqrt(tl.sum(x * x, 1) + 1e-6)[:, None]


@triton.jit
def _pick(x, j, AXIS: tl.constexpr):
    """Index j along axis AXIS of x (rows r = arange(R) there): x [R] -> a scalar, [R, n] (AXIS 0) or [n, R]
    (AXIS 1) -> a vector [n], in x's dtype. A sum with -0.0, so exact to the bit (signed zeros included)."""
    r = tl.arange(0, x.shape[AXIS])
    if len(x.shape) == 1:
        hit = r == j
    elif AXIS == 0:
        hit = (r == j)[:, None]
    else:
        hit = (r == j)[None, :]
    return tl.sum(tl.where(hit, x, -0.0), AXIS, dtype=x.dtype)


@triton.jit
def _norm_rows(o, zg, norm_w, out_rows, dv, v_mask, row_ok, eps, DV: tl.constexpr, PROD_TY: tl.constexpr):
    """The gated RMSNorm of gated_delta_decode's `_norm_output` for the rows of o [R, BV] (rounded as the recurrent
    kernel stores them) with their gates zg [R, BV] and the norm weight (fp32, broadcast to [R, BV]), stored at
    out_rows [R] + dv where row_ok."""
    o = tl.where(v_mask[None, :], o, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, 1) / DV + eps)
    y = (o * rstd[:, None]).to(out_rows.dtype.element_ty).to(tl.float32)
    y = (norm_w * y).to(PROD_TY).to(tl.float32)
    y = y * (zg / (1.0 + tl.exp(-zg)))
    tl.store(out_rows[:, None] + dv[None, :], y.to(out_rows.dtype.element_ty),
             mask=row_ok[:, None] & v_mask[None, :])


@triton.jit
def _rows_kernel(x_ptr, z_ptr, gates_ptr, convw_ptr, alog_ptr, dtb_ptr, normw_ptr, qsl_ptr, slot_ptr,
                 init_ptr, conv_ptr, ssm_ptr, cnt_ptr, out_ptr, eps, scale,
                 stride_xt, stride_zt, stride_gt, stride_ot, stride_cs, stride_cc, stride_ck, stride_ss,
                 HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, KW: tl.constexpr, BW: tl.constexpr, R: tl.constexpr, PROD_TY: tl.constexpr,
                 OUTPUT: tl.constexpr, PDL: tl.constexpr):
    """One value head h of one sequence of any number of rows (grid (Hv, B)): gated_delta_decode's math, the rows in
    chunks of R as the module docstring says. OUTPUT False: the states only (no q, z, norm or output)."""
    h, seq, kh, begin, end, init, state, s_mask, conv, q_ch, k_ch, v_ch, d_mask, v_mask, dv = program(
        qsl_ptr, slot_ptr, init_ptr, conv_ptr, ssm_ptr, stride_cs, stride_ss, HK, HV, DK, DV, BK, BV)
    n = end - begin
    if n > 0:
        S = tl.load(state, mask=s_mask & init, other=0.0)  # before the wait, as in the one-row kernel
        A_log = tl.load(alog_ptr + h).to(tl.float32)
        dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        x_seq = x_ptr + begin.to(tl.int64) * stride_xt
        for c0 in range(0, n, R):
            # The chunk's rows c0 .. c0+R-1, all at once: nothing here depends on the state.
            rows = c0 + tl.arange(0, R)
            row_ok = rows < n
            seq_rows = (begin + rows).to(tl.int64)
            # v as [BV, R]: a vector picked from it along R is a slice the compiler cannot broadcast into the state
            # tile's shape, so the state keeps its layout (picked from [R, BV], v handed the tile's layout to the
            # state: two 64 KiB conversions through shared memory, spills).
            v_all = rows_conv(x_seq, conv, v_ch, v_mask, init, convw_ptr, c0, n, stride_xt, stride_cc, stride_ck,
                              KW, R, BV, True)
            k_all = _l2_rows(rows_conv(x_seq, conv, k_ch, d_mask, init, convw_ptr, c0, n, stride_xt, stride_cc,
                                       stride_ck, KW, R, BK, False).to(tl.float32))
            gate_rows = gates_ptr + seq_rows * stride_gt
            decay = tl.exp(log_decay(tl.load(gate_rows + HV + h, mask=row_ok, other=0.0).to(tl.float32), dt_bias,
                                     A_log))
            beta_den = 1.0 + tl.exp(-tl.load(gate_rows + h, mask=row_ok, other=0.0).to(tl.float32))  # 1 / beta
            if OUTPUT:
                q_all = _l2_rows(rows_conv(x_seq, conv, q_ch, d_mask, init, convw_ptr, c0, n, stride_xt,
                                           stride_cc, stride_ck, KW, R, BK, False).to(tl.float32)) * scale
                out_mask = row_ok[:, None] & v_mask[None, :]
                zg = tl.load(z_ptr + seq_rows[:, None] * stride_zt + h * DV + dv[None, :], mask=out_mask,
                             other=0.0).to(tl.float32)
                # The norm weight in the output tile's shape (a load a row, from L1) gets the tile's layout; the
                # row mask keeps the load in the loop over chunks (else it is hoisted and held in registers).
                norm_w = tl.load(tl.broadcast_to(normw_ptr + dv[None, :], [R, BV]), mask=out_mask,
                                 other=0.0).to(tl.float32)
                o_all = tl.zeros([R, BV], dtype=tl.float32)
            # The serial part, row by row: what the state enters.
            for j in range(0, tl.minimum(n - c0, R)):
                k = _pick(k_all, j, 0)
                S = S * _pick(decay, j, 0)
                v = _pick(v_all, j, 1).to(tl.float32)  # picked in the rows' dtype: converted as the narrow type
                delta = (v - tl.sum(S * k[:, None], 0)) / _pick(beta_den, j, 0)
                S = S + k[:, None] * delta[None, :]
                if OUTPUT:
                    o = tl.sum(S * _pick(q_all, j, 0)[:, None], 0).to(out_ptr.dtype.element_ty).to(tl.float32)
                    o_all = tl.where((tl.arange(0, R) == j)[:, None], o[None, :], o_all)
            if OUTPUT:
                _norm_rows(o_all, zg, norm_w, out_ptr + seq_rows * stride_ot + h * DV, dv, v_mask, row_ok, eps, DV,
                           PROD_TY)
        tl.store(state, S, mask=s_mask)
        write_histories(conv, q_ch, k_ch, v_ch, d_mask, v_mask,
                         window_tail(x_seq, conv, q_ch, d_mask, init, n, stride_xt, stride_cc, stride_ck, KW, BW),
                         window_tail(x_seq, conv, k_ch, d_mask, init, n, stride_xt, stride_cc, stride_ck, KW, BW),
                         window_tail(x_seq, conv, v_ch, v_mask, init, n, stride_xt, stride_cc, stride_ck, KW, BW),
                         cnt_ptr + seq * HK + kh, stride_cc, stride_ck, HV // HK, KW, BW)
    elif tl.load(init_ptr + seq) == 0:
        zero_states(state, s_mask, conv, q_ch, k_ch, v_ch, d_mask, v_mask, h % (HV // HK) == 0, stride_cc,
                     stride_ck, KW, BK, BV, BW, PDL)
