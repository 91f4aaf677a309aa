"""One-shot all-reduce with no barrier ("Lamport" style), optionally fused with the residual add and RMSNorm.

Math: for partials x_0 .. x_{W-1} [T, H] of the W ranks, every rank computes s = sum_j x_j, added in rank order
j = 0, 1, .., W-1 in fp32 and rounded once to x's dtype (bf16, fp16, fp32), so that every rank gets the same bits.
The fused variant then computes, with `kernels/norm.py`'s rounding points, r' = round(s + r) and
y = w * round(r' * rsqrt(mean(r'^2) + eps)) (cast to the activation dtype), returning (y, r').

Buffers: each rank owns one receive buffer per dtype in symmetric memory (`distributed/lamport.py` allocates them),
[SLOTS, W, MAX_ELEMS] integers of x's width (int16 for bf16/fp16, int32 for fp32), every element holding the
sentinel: the bits of -0.0 (0x8000, 0x80000000). Slot s, row j of rank r's buffer receives rank j's partial of the
calls that use slot s. `LamportWorkspace.peers` holds the W buffers' base addresses (each mapped into this process).

Protocol of one call on rank r (slot s = state[0]):
  1. push: read x, replace -0.0 by +0.0 (harmless for a sum; it keeps data apart from the sentinel) and store it into
     slot s, row r of every other rank's buffer, over NVLink (remote stores; no flag, no barrier). Rank r's own row
     of its own buffer is never used: its partial is summed from registers.
  2. poll: read slot s, rows j != r of its own buffer with volatile loads until no element holds the sentinel (an
     element arrives whole: 2- and 4-byte stores are single-copy atomic), sum all rows in rank order, write the
     result (or the fused norm's outputs), and store the sentinel back into every element read.
  3. advance: each program counts itself done with an atomic (state[1]); the last one stores s + 1 mod SLOTS into
     state[0] and zeroes state[1]. Every program read state[0] before its atomic (acq_rel), so none reads it late.
     The state lives on the device: a call captured in a CUDA graph advances it on every replay.
A poll also gives up once state[2] (abort) is nonzero: a peer that died never pushes, and the host sets it from
another stream when the group fails (`distributed/lamport.py`), as NCCL's abort releases its kernels.
All ranks make the same calls in the same order (the model's forward runs on every rank), so slot s of call i is
the same on every rank.

Why SLOTS = 2 suffices (no rank writes into a slot a peer is still reading): rank r's call i + 2 writes into rank q's
slot s (= i mod 2). That call starts after r's call i + 1 has finished (kernels of one stream run in order, and a
kernel's stores are complete and visible when the next kernel starts), and r's call i + 1 finished only after it
read q's push of call i + 1, which q's call i + 1 made after q's call i had finished: after q had read slot s of call
i and stored the sentinel back. So q's reads and resets of slot s for call i precede r's writes for call i + 2. With
one slot, r's call i + 1 could overwrite (or q's reset could erase) data of call i + 1 while q still reads call i.
A stale value is never read either: what q reads in call i was written for call i, since slot s was reset at the end
of call i - 2 and nothing writes it in between.

Progress: a program pushes all its elements before it polls any, and the grid is at most `max_programs` (the SM
count), so every program of every rank is resident and pushes; a poll then waits only for peers' stores in flight.

Shapes: x [T, H] contiguous (any shape for the plain all-reduce: it is flattened), T*H <= MAX_ELEMS; weight [H].
Bytes per call and rank (b = element size, n = T*H): x read n*b (twice: push, then sum), (W-1)*n*b stored remotely,
(W-1)*n*b read and (W-1)*n*b reset locally, n*b written (fused: r read, y and r' written: 3*n*b more).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device
from orinfer.kernels.norm import MAX_FEATURES

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BITS = {2: torch.int16, 4: torch.int32}  # a buffer element's integer type by the data's width
SENTINEL = {2: -0x8000, 4: -0x80000000}  # -0.0's bits, as signed integers of that width
BLOCK = 1024  # elements a program moves at a time (plain all-reduce): 2 KB of bf16, 16 bytes a thread at 4 warps


@dataclass(frozen=True)
class LamportWorkspace:
    """What one rank's calls need: `peers` int64 [world], every rank's receive buffer's base address (this rank's
    own included; readable and writable by this process), `state` int32 [3] on the device (slot, programs done,
    abort: nonzero releases calls that wait for a peer), and the buffers' geometry. `max_programs`: the most
    programs a launch may have (all must be resident)."""
    peers: torch.Tensor
    state: torch.Tensor
    rank: int
    world: int
    slots: int
    max_elems: int
    max_programs: int


def fused_fits(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused add + RMSNorm kernel takes these operands (beyond `fits`): partial [T, H] with H at most
    norm.MAX_FEATURES, a contiguous residual of its shape and dtype, a weight [H]."""
    return (partial.dim() == 2 and partial.shape[1] <= MAX_FEATURES and residual.is_contiguous()
            and (residual.shape, residual.dtype) == (partial.shape, partial.dtype) and weight.shape == partial.shape[1:])


def fits(x: torch.Tensor, ws: LamportWorkspace) -> bool:
    """Whether the kernels take x (its dtype, layout and size)."""
    return x.dtype in DTYPES and x.is_contiguous() and 0 < x.numel() <= ws.max_elems


def _check(x: torch.Tensor, ws: LamportWorkspace) -> None:
    check_device(x)
    if not fits(x, ws):
        raise ValueError(f"lamport all-reduce: x {tuple(x.shape)} {x.dtype} (contiguous {x.is_contiguous()}) does "
                         f"not fit (dtypes {DTYPES}, at most {ws.max_elems} elements)")
    if (ws.peers.shape != (ws.world,) or ws.peers.dtype != torch.int64 or not 0 <= ws.rank < ws.world
            or ws.state.shape != (3,) or ws.state.dtype != torch.int32):
        raise ValueError(f"lamport all-reduce: rank {ws.rank} of {ws.world}, peers {tuple(ws.peers.shape)}, state "
                         f"{tuple(ws.state.shape)} {ws.state.dtype}")


def all_reduce_ref(partials: list[torch.Tensor]) -> torch.Tensor:
    """The sum every rank computes: fp32, in rank order, rounded once to the partials' dtype."""
    acc = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for part in partials:
        acc = acc + part.float()
    return acc.to(partials[0].dtype)


@triton.jit
def _poll(row_ptr, mask, abort_ptr, SENT: tl.constexpr):
    """Bits of one received row, read with volatile loads until none is the sentinel (0 where `mask` is off), or
    until the abort word is set (a peer died: the group is failing, the result is meaningless). The whole row is read
    again while any element is missing: arrived elements do not change until this rank resets them, and a full read
    keeps the 16-byte loads (a read of only the missing elements is one load per element)."""
    v = tl.load(row_ptr, mask=mask, other=0, volatile=True)
    waiting = tl.max((v == SENT).to(tl.int32)) > 0  # over every axis
    while waiting:
        v = tl.load(row_ptr, mask=mask, other=0, volatile=True)
        waiting = (tl.max((v == SENT).to(tl.int32)) > 0) & (tl.load(abort_ptr, volatile=True) == 0)
    return v


@triton.jit
def _buffer(peers_ptr, j, INT: tl.constexpr):
    """Rank j's receive buffer, as a pointer to integers of the data's width. Symmetric-memory allocations are aligned
    far beyond 16 bytes; saying so lets the compiler move 16 bytes a thread at a time (scalar accesses otherwise)."""
    return tl.multiple_of(tl.load(peers_ptr + j).to(tl.pointer_type(INT)), 16)


@triton.jit
def _push(bits_ptr, offs, mask, peers_ptr, slot_base, rank, max_elems, WORLD: tl.constexpr, SENT: tl.constexpr):
    """Stores x's bits at `offs` (-0.0 made +0.0) into row `rank` of the slot in every other rank's buffer."""
    int_ty = bits_ptr.dtype.element_ty
    bits = tl.load(bits_ptr + offs, mask=mask, other=0)
    bits = tl.where(bits == SENT, tl.zeros_like(bits), bits)
    for j in tl.static_range(WORLD):
        if j != rank:
            peer = _buffer(peers_ptr, j, int_ty)
            tl.store(peer + slot_base + rank * max_elems + offs, bits, mask=mask)


@triton.jit
def _gather_sum(bits_ptr, offs, mask, own_buf, slot_base, rank, max_elems, abort_ptr, ACT: tl.constexpr,
                WORLD: tl.constexpr, SENT: tl.constexpr):
    """The rank-order fp32 sum of every rank's values at `offs` (dtype ACT; this rank's read from x, the others
    polled from the slot, then reset to the sentinel)."""
    own = tl.load(bits_ptr + offs, mask=mask, other=0)
    own = tl.where(own == SENT, tl.zeros_like(own), own)
    acc = tl.zeros(offs.shape, tl.float32)
    for j in tl.static_range(WORLD):
        row = own_buf + slot_base + j * max_elems + offs
        peer_mask = mask & (j != rank)
        v = _poll(row, peer_mask, abort_ptr, SENT)
        tl.store(row, tl.full(offs.shape, SENT, own.dtype), mask=peer_mask)
        v = tl.where(j == rank, own, v)
        acc += v.to(ACT, bitcast=True).to(tl.float32)
    return acc


@triton.jit
def _advance(state_ptr, slot, SLOTS: tl.constexpr):
    """The last program to finish moves the slot on and re-arms the counter."""
    done = tl.atomic_add(state_ptr + 1, 1)
    if done == tl.num_programs(0) - 1:
        tl.store(state_ptr, (slot + 1) % SLOTS)
        tl.store(state_ptr + 1, 0)


@triton.jit
def _all_reduce_kernel(x_ptr, bits_ptr, peers_ptr, state_ptr, n, max_elems, rank,
                       WORLD: tl.constexpr, SLOTS: tl.constexpr, SENT: tl.constexpr, BLOCK: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    slot = tl.load(state_ptr)
    slot_base = (slot * WORLD).to(tl.int64) * max_elems
    own_buf = _buffer(peers_ptr, rank, bits_ptr.dtype.element_ty)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        _push(bits_ptr, offs, offs < n, peers_ptr, slot_base, rank, max_elems, WORLD, SENT)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        acc = _gather_sum(bits_ptr, offs, mask, own_buf, slot_base, rank, max_elems, state_ptr + 2,
                          x_ptr.dtype.element_ty, WORLD, SENT)
        tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=mask)
    _advance(state_ptr, slot, SLOTS)


@triton.jit
def _add_rms_norm_kernel(bits_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, peers_ptr, state_ptr, T, eps, max_elems, rank,
                         H: tl.constexpr, BLOCK_H: tl.constexpr, WORLD: tl.constexpr, SLOTS: tl.constexpr,
                         SENT: tl.constexpr):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    act_ty = r_ptr.dtype.element_ty
    slot = tl.load(state_ptr)
    slot_base = (slot * WORLD).to(tl.int64) * max_elems
    own_buf = _buffer(peers_ptr, rank, bits_ptr.dtype.element_ty)
    cols = tl.arange(0, BLOCK_H)[None, :]  # one row as a [1, BLOCK_H] tile, as kernels/norm.py holds it
    col_mask = cols < H
    for row in range(pid, T, nprog):
        _push(bits_ptr, row * H + cols, col_mask, peers_ptr, slot_base, rank, max_elems, WORLD, SENT)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    for row in range(pid, T, nprog):
        offs = row * H + cols
        s = _gather_sum(bits_ptr, offs, col_mask, own_buf, slot_base, rank, max_elems, state_ptr + 2, act_ty, WORLD,
                        SENT)
        r = tl.load(r_ptr + offs, mask=col_mask, other=0.0).to(tl.float32)
        # kernels/norm.py's steps from here: the all-reduce's result rounded, the new residual rounded
        x = (s.to(act_ty).to(tl.float32) + r).to(act_ty)
        tl.store(res_out_ptr + offs, x, mask=col_mask)
        x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps)
        y = (x * rstd[:, None]).to(act_ty).to(tl.float32)
        tl.store(out_ptr + offs, (w * y).to(out_ptr.dtype.element_ty), mask=col_mask)
    _advance(state_ptr, slot, SLOTS)


def _programs(needed: int, ws: LamportWorkspace) -> int:
    return max(1, min(needed, ws.max_programs))


def lamport_all_reduce_(x: torch.Tensor, ws: LamportWorkspace) -> torch.Tensor:
    """Sums x over the ranks in place (see the module docstring); returns x. x: contiguous bf16/fp16/fp32, at most
    `ws.max_elems` elements. Grid: min(cdiv(n, BLOCK), max_programs) programs of BLOCK elements at a time."""
    _check(x, ws)
    n = x.numel()
    bits = x.view(BITS[x.element_size()])
    _all_reduce_kernel[(_programs(triton.cdiv(n, BLOCK), ws),)](
        x, bits, ws.peers, ws.state, n, ws.max_elems, ws.rank, WORLD=ws.world, SLOTS=ws.slots,
        SENT=SENTINEL[x.element_size()], BLOCK=BLOCK, num_warps=4)
    return x


def lamport_all_reduce_add_rms_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                    ws: LamportWorkspace) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s + residual) * weight, s + residual) for s the all-reduce of `partial` [T, H] over the ranks, with
    `kernels/norm.py`'s rounding (`rms_norm_ref(all_reduce_ref(partials), weight, eps, residual)`); partial and
    residual are not written. weight [H] in any float dtype (a zero-centred norm's 1 + w in fp32). Grid:
    min(T, max_programs) programs, each owning whole rows (a row's sum of squares stays in one program), BLOCK_H =
    next_pow2(H) features in registers."""
    _check(partial, ws)
    if not fused_fits(partial, residual, weight):
        raise ValueError(f"lamport add + rms_norm: partial {tuple(partial.shape)} {partial.dtype}, residual "
                         f"{tuple(residual.shape)} {residual.dtype}, weight {tuple(weight.shape)}")
    t, h = partial.shape
    weight = weight.contiguous()
    out = torch.empty_like(partial)
    res_out = torch.empty_like(partial)
    block_h = triton.next_power_of_2(h)
    _add_rms_norm_kernel[(_programs(t, ws),)](
        partial.view(BITS[partial.element_size()]), residual, weight, out, res_out, ws.peers, ws.state, t, eps,
        ws.max_elems, ws.rank, H=h, BLOCK_H=block_h, WORLD=ws.world, SLOTS=ws.slots,
        SENT=SENTINEL[partial.element_size()], num_warps=max(1, min(16, block_h // 512)))
    return out, res_out
