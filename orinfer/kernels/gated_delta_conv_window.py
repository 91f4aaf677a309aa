"""The conv-history side of the fused Gated DeltaNet step kernels (kernels/gated_delta_decode.py, and
kernels/gated_delta_rows.py's row loop), and what a program of theirs works on (`program`): each sequence's
conv window (its K-1 previous inputs from the conv state slot, then the step's rows), the conv at a row with the conv
kernel's (kernels/causal_conv.py) sums and rounding, and the new history written back under the key head's
last-reader ownership (that module's docstring). Channel vectors `ch` index the [C] conv channels of one program (a
key head's q or k, a value head's v); `conv` is the sequence's slot of conv_states [slots, C, K-1] (strides
stride_cc, stride_ck); histories are tiles [channels, BW] whose first K-1 columns count.
"""

from __future__ import annotations

import triton
import triton.language as tl

from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def program(qsl_ptr, slot_ptr, init_ptr, conv_ptr, ssm_ptr, stride_cs, stride_ss, HK: tl.constexpr,
             HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """What a program of grid (Hv, B) works on: value head h of sequence `seq`, its key head, rows [begin, end),
    flag, state tile pointers and mask, conv history base and channel indices."""
    h = tl.program_id(0)
    seq = tl.program_id(1)
    kh = h // (HV // HK)
    begin = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    init = tl.load(init_ptr + seq) != 0
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    d = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    d_mask = d < DK
    v_mask = dv < DV
    state = ssm_ptr + slot * stride_ss + h * (DK * DV) + d[:, None] * DV + dv[None, :]
    s_mask = d_mask[:, None] & v_mask[None, :]
    q_ch = kh * DK + d
    return (h, seq, kh, begin, end, init, state, s_mask, conv_ptr + slot * stride_cs, q_ch, HK * DK + q_ch,
            2 * HK * DK + h * DV + dv, d_mask, v_mask, dv)


@triton.jit
def kept_history(conv, ch, mask, init, stride_cc, stride_ck, KW: tl.constexpr, BW: tl.constexpr):
    """The last K-2 columns of channels `ch`'s conv history, in the first K-2 of [n, BW] (what stays in the new
    history), in the state's dtype; zeros without an initial state."""
    e = tl.arange(0, BW)
    return tl.load(conv + ch[:, None] * stride_cc + (e + 1)[None, :] * stride_ck,
                   mask=mask[:, None] & (e < KW - 2)[None, :] & init, other=0.0)


@triton.jit
def conv_silu(x, conv, ch, mask, init, w_ptr, stride_cc, stride_ck, KW: tl.constexpr):
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
def with_row(kept, x, KW: tl.constexpr, BW: tl.constexpr):
    """The new history after one row: the old one's last K-2 columns (`kept`), then the row's inputs x."""
    e = tl.arange(0, BW)
    return tl.where((e == KW - 2)[None, :], x.to(kept.dtype)[:, None], kept)


@triton.jit
def rows_conv(x_seq, conv, ch, mask, init, w_ptr, c0, n, stride_xt, stride_cc, stride_ck, KW: tl.constexpr,
              R: tl.constexpr, BD: tl.constexpr, BY_CHANNEL: tl.constexpr):
    """`conv_silu` at rows c0 .. c0+R-1 of a sequence of n rows starting at x_seq (rows past n give zeros), as one
    tile, [R, BD] (BY_CHANNEL: [BD, R]), in the rows' dtype: row j's window positions j .. j+K-1, those below K-1
    from the history (zeros without an initial state), the others the rows p - (K-1), summed tap by tap in fp32 as
    the conv kernel sums them, rounded as it stores them.
    Layout: every load is of one row or one tap ([1, BD] or [BD, 1]), so each thread holds one channel of every
    row and the tile needs no layout conversion (loads of the tile's shape took two layouts, the rows' contiguous
    channels vectorized beside the history's and the weights' strided ones, and each conversion between them cost a
    shared-memory round trip; the weights were also loaded once per row)."""
    r = tl.arange(0, R)
    if BY_CHANNEL:
        c2 = ch[:, None]
        m2 = mask[:, None]
        pick = r[None, :]
        acc = tl.zeros([BD, R], dtype=tl.float32)
    else:
        c2 = ch[None, :]
        m2 = mask[None, :]
        pick = r[:, None]
        acc = tl.zeros([R, BD], dtype=tl.float32)
    for i in tl.static_range(KW):
        # The mask's c0 < n keeps the load in the caller's loop over chunks (else it is hoisted and held).
        w = tl.load(w_ptr + c2 * KW + i, mask=m2 & (c0 < n), other=0.0).to(tl.float32)
        for j in tl.static_range(R):
            p = c0 + j + i  # window position of row c0 + j's tap i
            ok = m2 & (c0 + j < n)
            hist = conv + c2 * stride_cc + p * stride_ck
            row = x_seq + (p - (KW - 1)).to(tl.int64) * stride_xt + c2
            if conv.dtype.element_ty == x_seq.dtype.element_ty:  # one load from either
                xv = tl.load(tl.where(p < KW - 1, hist, row), mask=ok & (init | (p >= KW - 1)), other=0.0)
                xv = xv.to(tl.float32)
            else:  # the conv kernel's two loads, one masked to 0
                xv = (tl.load(row, mask=ok & (p >= KW - 1), other=0.0).to(tl.float32)
                      + tl.load(hist, mask=ok & (p < KW - 1) & init, other=0.0).to(tl.float32))
            acc = tl.where(pick == j, acc + xv * w, acc)
    return (acc / (1.0 + tl.exp(-acc))).to(x_seq.dtype.element_ty)


@triton.jit
def window_tail(x_seq, conv, ch, mask, init, n, stride_xt, stride_cc, stride_ck, KW: tl.constexpr,
                 BW: tl.constexpr):
    """The new history of channels `ch` after n rows, [n_ch, BW] in the history's dtype: the window's last K-1
    inputs (positions n .. n+K-2: the old history's below K-1, else the rows')."""
    e = tl.arange(0, BW)
    p = n + e
    in_x = (p >= KW - 1)[None, :]
    m = mask[:, None] & (e < KW - 1)[None, :]
    xv = tl.load(x_seq + (p - (KW - 1)).to(tl.int64)[None, :] * stride_xt + ch[:, None], mask=m & in_x, other=0.0)
    hv = tl.load(conv + ch[:, None] * stride_cc + p[None, :] * stride_ck, mask=m & ~in_x & init, other=0.0)
    return tl.where(in_x, xv.to(conv.dtype.element_ty), hv)


@triton.jit
def store_history(conv, ch, mask, new, stride_cc, stride_ck, KW: tl.constexpr, BW: tl.constexpr):
    """History tile `new` [n_ch, BW] (its first K-1 columns) as channels `ch`'s conv history."""
    e = tl.arange(0, BW)
    tl.store(conv + ch[:, None] * stride_cc + e[None, :] * stride_ck, new, mask=mask[:, None] & (e < KW - 1)[None, :])


@triton.jit
def write_histories(conv, q_ch, k_ch, v_ch, d_mask, v_mask, q_new, k_new, v_new, counter, stride_cc, stride_ck,
                     GROUP: tl.constexpr, KW: tl.constexpr, BW: tl.constexpr):
    """The new conv histories, once every thread's reads of the old ones are done: the v history of this program's
    head, and the key head's q/k history by its group's last reader (the module docstring's ownership)."""
    tl.debug_barrier()
    store_history(conv, v_ch, v_mask, v_new, stride_cc, stride_ck, KW, BW)
    if GROUP == 1:
        store_history(conv, q_ch, d_mask, q_new, stride_cc, stride_ck, KW, BW)
        store_history(conv, k_ch, d_mask, k_new, stride_cc, stride_ck, KW, BW)
    else:
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == GROUP - 1:  # the key head's last reader
            store_history(conv, q_ch, d_mask, q_new, stride_cc, stride_ck, KW, BW)
            store_history(conv, k_ch, d_mask, k_new, stride_cc, stride_ck, KW, BW)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _zero_history(conv, ch, mask, stride_cc, stride_ck, KW: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr):
    """Zeros as the history of channels `ch` [BD]."""
    store_history(conv, ch, mask, tl.zeros([BD, BW], dtype=conv.dtype.element_ty), stride_cc, stride_ck, KW, BW)


@triton.jit
def zero_states(state, s_mask, conv, q_ch, k_ch, v_ch, d_mask, v_mask, first_of_group, stride_cc, stride_ck,
                 KW: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr):
    """No row and no initial state: the slot's states become zeros, as the unfused kernels leave them (nobody reads
    the old ones, so the group's first program may write the q/k history)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(state, tl.zeros([BK, BV], dtype=tl.float32), mask=s_mask)
    _zero_history(conv, v_ch, v_mask, stride_cc, stride_ck, KW, BV, BW)
    if first_of_group:
        _zero_history(conv, q_ch, d_mask, stride_cc, stride_ck, KW, BK, BW)
        _zero_history(conv, k_ch, d_mask, stride_cc, stride_ck, KW, BK, BW)
