"""The causal depthwise conv of Gated DeltaNet (`gated_delta.causal_conv1d_ref`'s contract) in Triton.

Math per channel c of sequence b (rows n, kernel width K, window = the sequence's K-1 previous inputs, then its
rows): out[r, c] = silu(sum_j w[c, j] window[r + j, c]), fp32 inside; the previous inputs come from the sequence's
conv state slot (zeros when it has no initial state), and the slot is rewritten with the window's last K-1 inputs.
Shapes: x [T, C] (unit last stride, free row stride: a view of the projection output), weight [C, K],
conv_states [slots, C, K-1]. Traffic: x read once (its K-1 rows before each block again, from cache), out written
once, and 2 (K-1) C state elements per sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.gated_delta_chunk import sequence_chunk
from orinfer.kernels.gemv import check_device, interpreting


@triton.jit
def _tap(w_ptr, ch, c_mask, j, KW: tl.constexpr):
    """Tap j of the channels' kernels as a [1, BLOCK_C] fp32 row."""
    return tl.load(w_ptr + ch * KW + j, mask=c_mask, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _store_silu(out_ptr, begin, rows, ch, mask, acc, stride_ot):
    """silu(acc) stored at the sequence's `rows` (x row begin + row) and channels `ch`."""
    out = acc / (1.0 + tl.exp(-acc))
    at = out_ptr + (begin + rows).to(tl.int64)[:, None] * stride_ot + ch[None, :]
    tl.store(at, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_seqs"])
def _causal_conv_kernel(x_ptr, w_ptr, qsl_ptr, state_ptr, slot_ptr, init_ptr, out_ptr, num_seqs, C,
                        stride_xt, stride_ot, stride_ss, stride_sc, stride_sk,
                        KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
                        BLOCK_S: tl.constexpr):
    """BLOCK_T rows of one sequence x BLOCK_C channels. Grid (T // BLOCK_T + B, cdiv(C, BLOCK_C)): every sequence,
    empty ones too, owns at least one row block; programs past the last do nothing.

    The program of a sequence's first row block is the only one that reads its old state (rows r < K-1 look back
    into it), so it also writes the new one: reads of the old values, a block-wide barrier, then the store. The new
    state comes from x's last K-1 rows, or, for a sequence shorter than K-1, partly from the old state."""
    seq, chunk = sequence_chunk(qsl_ptr, num_seqs, tl.program_id(0), BLOCK_T, True, BLOCK_S)
    if seq < num_seqs:
        begin = tl.load(qsl_ptr + seq)
        n = tl.load(qsl_ptr + seq + 1) - begin
        init = tl.load(init_ptr + seq) != 0
        state = state_ptr + tl.load(slot_ptr + seq).to(tl.int64) * stride_ss
        ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = ch < C
        # Rows r >= K-1: a window inside x. The first K-1 rows of a sequence (the only ones whose window reaches
        # into the old state) are left to the smaller tile below, so that this one forms no state address: as one
        # tile, its per-channel-strided state loads (a predicated 2-byte load an element) took the kernel to 255
        # registers with spills and ~5x its bandwidth time (Qwen3.5-35B-A3B, 2048 tokens: 83 us a layer, run 464).
        r = chunk * BLOCK_T + tl.arange(0, BLOCK_T)  # rows within the sequence
        r_mask = (r < n)[:, None] & c_mask[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(KW):
            p = r + j  # window position: x row begin + p - (K-1) where p >= K-1
            xv = tl.load(x_ptr + (begin + p - (KW - 1)).to(tl.int64)[:, None] * stride_xt + ch[None, :],
                         mask=r_mask & (p >= KW - 1)[:, None], other=0.0).to(tl.float32)
            acc += xv * _tap(w_ptr, ch, c_mask, j, KW)
        _store_silu(out_ptr, begin, r, ch, r_mask & (r >= KW - 1)[:, None], acc, stride_ot)
        if chunk == 0:
            # The first K-1 rows, their windows across the old state and x.
            e = tl.arange(0, BLOCK_W)
            e_mask = ((e < KW - 1) & (e < n))[:, None] & c_mask[None, :]
            head = tl.zeros([BLOCK_W, BLOCK_C], dtype=tl.float32)
            for j in tl.static_range(KW):
                pe = e + j  # (a name of its own: `p` holds the larger tile's positions)
                in_x = (pe >= KW - 1)[:, None]
                xe = tl.load(x_ptr + (begin + pe - (KW - 1)).to(tl.int64)[:, None] * stride_xt + ch[None, :],
                             mask=e_mask & in_x, other=0.0).to(tl.float32)
                he = tl.load(state + ch[None, :] * stride_sc + pe[:, None] * stride_sk, mask=e_mask & ~in_x & init,
                             other=0.0).to(tl.float32)
                head += (xe + he) * _tap(w_ptr, ch, c_mask, j, KW)
            _store_silu(out_ptr, begin, e, ch, e_mask, head, stride_ot)
            # The new state: the window's last K-1 positions.
            last = n + e
            last_in_x = (last >= KW - 1)[None, :]
            s_mask = c_mask[:, None] & (e < KW - 1)[None, :]
            x_last = tl.load(x_ptr + (begin + last - (KW - 1)).to(tl.int64)[None, :] * stride_xt + ch[:, None],
                             mask=s_mask & last_in_x, other=0.0)
            h_last = tl.load(state + ch[:, None] * stride_sc + last[None, :] * stride_sk,
                             mask=s_mask & ~last_in_x & init, other=0.0)
            new = tl.where(last_in_x, x_last.to(state_ptr.dtype.element_ty), h_last)
            tl.debug_barrier()  # every thread's reads of the old state (above and for the outputs) come first
            tl.store(state + ch[:, None] * stride_sc + e[None, :] * stride_sk, new, mask=s_mask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, query_start_loc: torch.Tensor, conv_states: torch.Tensor,
                  state_slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """`causal_conv1d_ref`'s contract: x [T, C] (unit last stride), weight [C, K], query_start_loc [B+1] int32,
    conv_states [slots, C, K-1] (any strides, written in place), state_slots [B] int, has_initial_state [B] bool ->
    new contiguous out [T, C] in x's dtype. Rows past query_start_loc[B] (padding) are left unwritten.

    Kernel: `_causal_conv_kernel`, grid (T // BLOCK_T + B, cdiv(C, BLOCK_C)) from the shapes alone (no host sync;
    CUDA-graph capturable), each program finding its sequence and row block from query_start_loc on the device.
    """
    check_device(x)
    tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = state_slots.shape[0]
    if (weight.shape != (channels, width) or width < 2 or conv_states.shape[1:] != (channels, width - 1)
            or query_start_loc.shape != (num_seqs + 1,) or has_initial_state.shape != (num_seqs,)):
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_states "
                         f"{tuple(conv_states.shape)}, query_start_loc {tuple(query_start_loc.shape)}, "
                         f"has_initial_state {tuple(has_initial_state.shape)} for {num_seqs} sequences do not match")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    if num_seqs == 0 or channels == 0:
        return out
    # Decode batches (a row per sequence) take short row blocks; prompts 32 rows x 128 channels (16 KiB of bf16 in,
    # 16 KiB out a program). Small blocks in the interpreter, so that short test sequences cross them.
    block_t = 4 if interpreting() else (16 if tokens <= num_seqs else 32)
    block_t = max(block_t, triton.next_power_of_2(width - 1))  # the first block holds the old state's readers
    block_c = min(128, triton.next_power_of_2(channels))
    grid = (tokens // block_t + num_seqs, triton.cdiv(channels, block_c))
    _causal_conv_kernel[grid](
        x, weight, query_start_loc, conv_states, state_slots, has_initial_state, out, num_seqs, channels,
        x.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        KW=width, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(width - 1),
        BLOCK_S=triton.next_power_of_2(num_seqs), num_warps=4)
    return out
