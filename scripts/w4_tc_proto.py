"""Prototype (session 10, not used by the engine): a one-row W4 GEMV on mma.sync tensor cores, written in Gluon
(Triton's explicit-layout dialect) so that the operand layouts are ours, to A/B against `w4_gemv`.

A program owns BLOCK_N rows; its S warps split K (warp s takes chunks s, s + S, ...) as the batch dimension of a 3D
mma layout. Per chunk of 128 inputs: the [BLOCK_N, 16] int32 tile is unpacked in registers to eight bf16 operand
slices 128 + q (prmt + lop3, exact), multiplied with x's eight 16-input slices (x in column 0 of the 8-wide B
operand, zeros elsewhere), and the zero point comes back through the same MMA with an all-ones A: per row,
s * (sum (128 + q) x - (128 + z) sum x).

Why: `w4_gemv` spends ~3 SASS instructions per weight (one AND, one FMA, x and reduction work); this one compiles
to 1.9-2.3 (prmt + shift + lop3 per pair of weights, one HMMA per 256). Measured (run 104, scripts/w4_tc_ab.py and
scripts/gpu_session10.sh): correct (max relative error 3e-3, as the GEMV's), but slower: 52.3 us per Qwen3-8B layer
at the best tile per projection against 39.2, and the engine's batch-1 step 2.61 ms against 2.04. Each thread loads
8-byte pieces of 16 rows (the MMA operand layout over the W4 rows), and ptxas interleaves the loads with the MMAs
instead of keeping them in flight. A layout repacked for this operand (16 contiguous bytes per thread, as Marlin
does) would be the next thing to try.

Session 11 options, all off by default (runs 111-112, scripts/w4_tc_ab.py, scripts/gpu_session11.sh):
- PERM: 16-byte loads without repacking. The MMA's k order within a 16-input slice is free as long as x follows it,
  so slot 8a + 2t + b takes int32 4t + 2a + b: each lane then needs four contiguous int32 of its rows, loaded as one
  LDG.128, and the reshaped, permuted tile is already in the operand's registers (the layout conversion is checked
  trivial at compile time; x takes the same permutation with 8-byte loads).
- EARLY_SZ: scales and zero points loaded with the weights (they were loaded after the MMAs: one more memory round
  trip at the end of every program). x is loaded one step ahead instead of all up front (fewer registers).
- FENCE: the first MMA depends on every loaded weight, scale and zero point (through a runtime zero), so that all
  loads are issued before any MMA, as `w4_gemv` does; without it LLVM sinks each load next to its use.
Still slower: best qkv 8.1 us against 5.7, o 5.4 against 4.5, gate_up 22.6 against 18.4, down 15.4 against 10.6
(51.5 us per layer against 39.2); engine step 2.16-2.53 ms against 2.03. The fence made gate_up slower (22.6 without,
26-32 with). Max relative error on qkv: 5.7e-3 against 3e-5 for `w4_gemv` in run 111, 5.0e-3 for both in run 112
(new random data): outputs one bf16 rounding step apart, from a different fp32 summation order.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from orinfer.kernels.w4 import W4Weight
from orinfer.kernels.w4_mma import _unpack_asm


# eight bf16 pairs (128 + q_p(k), 128 + q_p(k + 1)) per pair of int32 (inputs k, k + 1 of one row)
_UNPACK_MAGIC = gl.constexpr(_unpack_asm(0x43004300, 0x3F803F80, "bf16x2", subtract=False))


@gluon.jit
def _idx3(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, L: gl.constexpr):
    a = gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    b = gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    c = gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    return (gl.expand_dims(gl.expand_dims(a, 1), 2), gl.expand_dims(gl.expand_dims(b, 0), 2),
            gl.expand_dims(gl.expand_dims(c, 0), 1))


@gluon.jit
def _idx4(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, n3: gl.constexpr, L: gl.constexpr):
    a = gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))
    b = gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))
    c = gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))
    d = gl.arange(0, n3, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))
    return (gl.expand_dims(gl.expand_dims(gl.expand_dims(a, 1), 2), 3),
            gl.expand_dims(gl.expand_dims(gl.expand_dims(b, 0), 2), 3),
            gl.expand_dims(gl.expand_dims(gl.expand_dims(c, 0), 1), 3),
            gl.expand_dims(gl.expand_dims(gl.expand_dims(d, 0), 1), 2))


@gluon.jit
def _idx2(n0: gl.constexpr, n1: gl.constexpr, L: gl.constexpr):
    a = gl.arange(0, n0, layout=gl.SliceLayout(1, L))
    b = gl.arange(0, n1, layout=gl.SliceLayout(0, L))
    return gl.expand_dims(a, 1), gl.expand_dims(b, 0)


@gluon.jit
def _chunk(acc, w, xs, ones, z, sc, init):
    """acc + s * (sum_p (128 + q_p) x_p - (128 + z) sum x) for one chunk: the int32 tile `w`, x's eight slices `xs`
    (B operands), `ones` an all-ones A operand, the chunk's zero points `z` and scales `sc` (fp32); `init`: zeros
    (or zeros that depend on values that must be loaded before the first MMA)."""
    planes = gl.inline_asm_elementwise(_UNPACK_MAGIC, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w],
                                       dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
    part = mma_v2(planes[0], xs[0], init)
    sx = mma_v2(ones, xs[0], gl.zeros_like(acc))
    for p in gl.static_range(1, 8):
        part = mma_v2(planes[p], xs[p], part)
        sx = mma_v2(ones, xs[p], sx)
    return acc + (part - gl.expand_dims(z + 128.0, 2) * sx) * gl.expand_dims(sc, 2)


@gluon.jit
def _x_step(xp, x_mask, S: gl.constexpr, B_L: gl.constexpr, PERM: gl.constexpr):
    """x's eight 16-input slices of a step as B operands (`xp`: plane 0's addresses)."""
    return (_x_operand(gl.load(xp, mask=x_mask, other=0.0), S, B_L, PERM),
            _x_operand(gl.load(xp + 16, mask=x_mask, other=0.0), S, B_L, PERM),
            _x_operand(gl.load(xp + 32, mask=x_mask, other=0.0), S, B_L, PERM),
            _x_operand(gl.load(xp + 48, mask=x_mask, other=0.0), S, B_L, PERM),
            _x_operand(gl.load(xp + 64, mask=x_mask, other=0.0), S, B_L, PERM),
            _x_operand(gl.load(xp + 80, mask=x_mask, other=0.0), S, B_L, PERM),
            _x_operand(gl.load(xp + 96, mask=x_mask, other=0.0), S, B_L, PERM),
            _x_operand(gl.load(xp + 112, mask=x_mask, other=0.0), S, B_L, PERM))


TRIVIAL = gl.constexpr(True)    # compile-time check that the permuted tiles need no data movement


@gluon.jit
def _to_operand(w, S: gl.constexpr, BLOCK_N: gl.constexpr, A_L: gl.constexpr, PERM: gl.constexpr):
    """PERM: the [S, BLOCK_N, 4 (t), 4 (2a + b)] int32 tile as [S, BLOCK_N, 16] with k = 8a + 2t + b, in the MMA
    operand's layout (the same registers: the conversion must be trivial)."""
    if PERM:
        w = gl.reshape(w, [S, BLOCK_N, 4, 2, 2])
        w = gl.permute(w, [0, 1, 3, 2, 4])
        w = gl.reshape(w, [S, BLOCK_N, 16])
        w = gl.convert_layout(w, A_L, assert_trivial=TRIVIAL)
    return w


@gluon.jit
def _x_operand(x, S: gl.constexpr, B_L: gl.constexpr, PERM: gl.constexpr):
    """PERM: x's [S, 8 (n), 4 (t), 4 (2a + b)] slice as the B operand [S, 16 (k = 8a + 2t + b), 8 (n)]."""
    if PERM:
        x = gl.reshape(x, [S, 8, 4, 2, 2])
        x = gl.permute(x, [0, 3, 2, 4, 1])
        x = gl.reshape(x, [S, 16, 8])
        x = gl.convert_layout(x, B_L, assert_trivial=TRIVIAL)
    return x


@gluon.jit
def _round16(v):
    return v.to(gl.bfloat16).to(gl.float32)


@gluon.jit
def w4_tc_gemv_kernel(x_ptr, qw_ptr, sc_ptr, zp_ptr, out_ptr, N_OUT, stride_qw, stride_sg, UP, ZERO,
                      G8: gl.constexpr, S: gl.constexpr, BLOCK_N: gl.constexpr, STEPS: gl.constexpr,
                      GATED: gl.constexpr, PDL: gl.constexpr, PERM: gl.constexpr = False,
                      EARLY_SZ: gl.constexpr = False, FENCE: gl.constexpr = False):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[S, 1, 1], instr_shape=[1, 16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    SM: gl.constexpr = gl.SliceLayout(2, MMA)
    # lanes as in the MMA operands: row (or B column) lane // 4, t = lane % 4; four int32 (or inputs) per lane
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [S, 1, 1, 1], [3, 2, 1, 0])
    pid = gl.program_id(0)
    row0 = pid * BLOCK_N
    if PERM:
        # Session 11: each lane loads the 16 contiguous bytes (int32 4t .. 4t + 3) of its rows, and the MMA's k-slots
        # are permuted to match: slot 8a + 2t + b <- int32 4t + 2a + b (the same permutation for x below), so the
        # loaded tile, reshaped and permuted, is already in the operand's registers (a trivial layout conversion).
        s4, r4, t4, i4 = _idx4(S, BLOCK_N, 4, 4, L4)
        w_off = gl.minimum(row0 + r4, N_OUT - 1) * stride_qw + s4 * 16 + t4 * 4 + i4
    else:
        sa, ra, ka = _idx3(S, BLOCK_N, 16, A_L)
        w_off = gl.minimum(row0 + ra, N_OUT - 1) * stride_qw + sa * 16 + ka      # chunk s of the row, int32 r
    ss, rs = _idx2(S, BLOCK_N, SM)
    s_row = gl.minimum(row0 + rs, N_OUT - 1) * stride_sg
    if PERM:
        # x as [S, 8 (n), 4 (t), 4 (2a + b)]: 8 contiguous bytes per lane, then the same permutation as the weights
        sb, nb, tb, ib = _idx4(S, 8, 4, 4, L4)
        x_off = sb * 128 + tb * 4 + ib + nb * 0
        x_mask = (nb == 0) & (tb >= 0) & (ib >= 0) & (sb >= 0)
    else:
        sb, kb, nb = _idx3(S, 16, 8, B_L)
        x_off = sb * 128 + kb + nb * 0                   # (+ nb * 0: broadcast to the operand's [S, 16, 8] shape)
        x_mask = (nb == 0) & (kb >= 0) & (sb >= 0)
    acc_g = gl.zeros([S, BLOCK_N, 8], gl.float32, MMA)
    acc_u = gl.zeros([S, BLOCK_N, 8], gl.float32, MMA)
    ones = gl.full([S, BLOCK_N, 16], 1.0, gl.bfloat16, A_L)
    if PDL:
        gdc_wait()
    # The weight loads of every step written first (STEPS is small), so that a step's loads are not issued only after
    # the previous step's MMAs (run 103's order); the compiler still moves them between the MMAs unless FENCE. (Run 104
    # also loaded x for every step up front; since session 11 x comes one step ahead.)
    wgs = ()
    wus = ()
    szs = ()
    for i in gl.static_range(STEPS):
        c = i * S
        wgs = wgs + (_to_operand(gl.load(qw_ptr + w_off + c * 16), S, BLOCK_N, A_L, PERM),)
        if GATED:
            wus = wus + (_to_operand(gl.load(qw_ptr + w_off + UP * stride_qw + c * 16), S, BLOCK_N, A_L, PERM),)
    if EARLY_SZ:
        # session 11: scales and zero points with the weights, not after the MMAs (run 104's order made every program
        # wait one more memory round trip at its end)
        for i in gl.static_range(STEPS):
            sz = s_row + (i * S + ss) * 16 // G8
            szs = szs + ((gl.load(zp_ptr + sz).to(gl.float32), gl.load(sc_ptr + sz).to(gl.float32)),)
            if GATED:
                szs = szs + ((gl.load(zp_ptr + sz + UP * stride_sg).to(gl.float32),
                              gl.load(sc_ptr + sz + UP * stride_sg).to(gl.float32)),)
    init = gl.zeros_like(acc_g)
    if FENCE:
        # Make the first MMA depend on every weight, scale and zero point (through ZERO, a runtime 0 the compiler cannot
        # fold), so that all of them are requested before any MMA, as `w4_gemv` does: LLVM otherwise sinks each load
        # next to its use, between the MMAs.
        dep = wgs[0]
        for i in gl.static_range(1, STEPS):
            dep = dep ^ wgs[i]
        if GATED:
            for i in gl.static_range(STEPS):
                dep = dep ^ wus[i]
        wgs = (wgs[0] ^ (dep & ZERO),) + wgs[1:]
        if EARLY_SZ:
            sdep = szs[0][0] + szs[0][1]
            for i in gl.static_range(1, len(szs)):
                sdep = sdep + szs[i][0] + szs[i][1]
            init = init + gl.expand_dims(sdep * 0.0, 2)
    # x (L1/L2-resident) one step ahead of the MMAs, so that it does not hold registers for every step at once
    xs_next = _x_step(x_ptr + x_off, x_mask, S, B_L, PERM)
    for i in gl.static_range(STEPS):
        c = i * S
        xs = xs_next
        if i + 1 < STEPS:
            xs_next = _x_step(x_ptr + x_off + (c + S) * 128, x_mask, S, B_L, PERM)
        if EARLY_SZ:
            zg, sg = szs[i * (2 if GATED else 1)]
        else:
            sz = s_row + (c + ss) * 16 // G8
            zg = gl.load(zp_ptr + sz).to(gl.float32)
            sg = gl.load(sc_ptr + sz).to(gl.float32)
        acc_g = _chunk(acc_g, wgs[i], xs, ones, zg, sg, init if i == 0 else gl.zeros_like(acc_g))
        if GATED:
            if EARLY_SZ:
                zu, su = szs[i * 2 + 1]
            else:
                zu = gl.load(zp_ptr + sz + UP * stride_sg).to(gl.float32)
                su = gl.load(sc_ptr + sz + UP * stride_sg).to(gl.float32)
            acc_u = _chunk(acc_u, wus[i], xs, ones, zu, su, gl.zeros_like(acc_u))
    if PDL:
        gdc_launch_dependents()
    g = gl.sum(gl.sum(acc_g, axis=2), axis=0)
    if GATED:
        u = gl.sum(gl.sum(acc_u, axis=2), axis=0)
        g = _round16(g)
        g = _round16(g / (1.0 + gl.exp(-g))) * _round16(u)
    orows = row0 + gl.arange(0, BLOCK_N, layout=g.type.layout)
    gl.store(out_ptr + orows, g.to(gl.bfloat16), mask=orows < N_OUT)


def w4_tc_gemv(x: torch.Tensor, w: W4Weight, gated: bool = False, block_n: int = 32, warps: int = 4,
               pdl: bool = True, perm: bool = False, early_sz: bool = False, fence: bool = False) -> torch.Tensor:
    """One bf16 row x [K] -> [N] (gated: [N/2] = silu(gate) * up). Group size a multiple of 128."""
    k, n = w.in_features, w.out_features
    assert x.dtype == torch.bfloat16 and x.numel() == k and w.group_size % 128 == 0
    chunks = k // 128
    assert chunks % warps == 0, (chunks, warps)
    n_out = n // 2 if gated else n
    out = torch.empty(n_out, dtype=x.dtype, device=x.device)
    w4_tc_gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x.reshape(k), w.packed, w.scales, w.zeros, out, n_out, w.packed.stride(0), w.scales.stride(0),
        n_out if gated else 0, 0, G8=w.group_size // 8, S=warps, BLOCK_N=block_n, STEPS=chunks // warps,
        GATED=gated, PDL=pdl, PERM=perm, EARLY_SZ=early_sz, FENCE=fence, num_warps=warps, launch_pdl=pdl)
    return out.reshape(*x.shape[:-1], n_out)


def install(configs: dict[str, dict]) -> None:
    """Route the engine's one-row bf16 W4 linears without bias through the prototype: `configs` maps a kind ("short":
    K <= 4096, "gated": gate_up, "long": K > 4096) to `w4_tc_gemv` keyword arguments; other kinds keep `w4_gemv`."""
    from orinfer.kernels import w4_ops

    old = w4_ops.w4_gemv

    def routed(x, w, bias=None, gated=False, cfg=None):
        kind = "gated" if gated else ("long" if w.in_features > 4096 else "short")
        kw = configs.get(kind)
        if kw is None or bias is not None or x.dtype != torch.bfloat16 or w.group_size % 128:
            return old(x, w, bias, gated=gated, cfg=cfg)
        return w4_tc_gemv(x, w, gated, **kw)

    w4_ops.w4_gemv = routed
