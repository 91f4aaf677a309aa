"""Prototype (session 11, not used by the engine): the one-row W4 GEMV as a persistent, software-pipelined loop.

`w4_gemv` loads a program's whole tile into registers and then computes: with ~3 programs per SM, gate_up's 768
programs run in two waves, and within a wave every program waits for its loads and then computes at the same time,
so memory and ALU work take turns (run 79: gate_up 17.3 us against 11.9 at the read ceiling and ~9 us of ALU issue).

Here NPROG programs (a few per SM) each walk row blocks pid, pid + NPROG, ... in k-steps of 128 int32 (1024
inputs), and keep STAGES - 1 future steps in flight with cp.async into shared memory while the current step is
computed: memory and ALU overlap within every program, and registers hold one step, whatever the depth.

Written in Gluon so that the layouts are ours: the tile [BLOCK_N, 32, 4] int32 gives each lane four consecutive int32
(one 16-byte copy per row) of one 128-input chunk; x, the per-(row, chunk) scale and zero point, and the sums all
live in slices of that layout, so nothing crosses threads until the row's final warp reduction. Scales and zero
points come from `pack_scale_zero`: one int32 per (row, group), fp16 scale bits high, zero point low (cp.async moves
4 bytes at least). Math as `w4_gemv` (subnormal nibble planes, module docstring there): per row and group,
s * (sum q x - z sum x), fp32, rounded once to bf16. Group size: a multiple of 128. X_SMEM: x's scaled planes are
made once per program into shared memory instead of per step from global memory.

Measured (runs 110 and 112, scripts/w4_pipe_ab.py and scripts/gpu_session11.sh): correct, and slower for every shape and
config: best qkv 8.9 us against 6.0, o 7.0 against 4.6, gate_up 23.9 against 18.2, down 13.6 against 10.6 (53.4 us
per Qwen3-8B layer against 39.5); the engine's batch-1 step 2.31-2.54 ms with it everywhere, 2.19 with gate_up only,
against 2.03 (best config per kind from the sweep). Loading a program's whole tile at once (w4_gemv) already keeps the
most bytes in flight for rows this short; the pipelined loop costs 3.2-3.6 SASS instructions per weight against ~3
(cp.async addressing per row, two barriers per step that Triton's membar pass inserts, x work per step), plus a
serial prologue per program.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from orinfer.kernels.w4 import W4Weight
from orinfer.kernels.w4_gemv import _DOWN, _UP, _X_SCALE_0, _X_SCALE_1, _X_SCALE_2, _X_SCALE_3
from w4_tc_proto import _idx3, _round16


@gluon.jit
def _issue(t, n_iter, pid, NPROG, N_OUT, stride_qw, stride_sz, UP, qw_ptr, sz_ptr, w_smem, sz_smem, r3, l3, j3, r2, l2,
           GPS: gl.constexpr, KS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr):
    """cp.async the weights (and scale/zero words) of iteration t into slot t % STAGES; past the end, nothing moves
    (masked copies), but the group is still committed so that the wait counts stay uniform."""
    ks = t % KS
    row0 = (pid + (t // KS) * NPROG) * BLOCK_N
    live = t < n_iter
    slot = t % STAGES
    NB: gl.constexpr = 2 if GATED else 1
    rw = gl.minimum(row0 + r3, N_OUT - 1)
    w_off = rw * stride_qw + ks * 128 + l3 * 4 + j3
    async_copy.async_copy_global_to_shared(w_smem.index(slot * NB), qw_ptr + w_off, mask=(j3 >= 0) & live,
                                           cache_modifier=".cg")
    rs = gl.minimum(row0 + r2, N_OUT - 1)
    s_off = rs * stride_sz + (ks * 8 + l2 // 4) // GPS
    async_copy.async_copy_global_to_shared(sz_smem.index(slot * NB), sz_ptr + s_off, mask=(l2 >= 0) & live)
    if GATED:
        async_copy.async_copy_global_to_shared(w_smem.index(slot * NB + 1), qw_ptr + w_off + UP * stride_qw,
                                               mask=(j3 >= 0) & live, cache_modifier=".cg")
        async_copy.async_copy_global_to_shared(sz_smem.index(slot * NB + 1), sz_ptr + s_off + UP * stride_sz,
                                               mask=(l2 >= 0) & live)
    async_copy.commit_group()


@gluon.jit
def _plane(w, w_hi, P: gl.constexpr):
    word = w if P < 4 else w_hi
    return (word & (15 << (4 * (P % 4)))).to(gl.float32, bitcast=True)


@gluon.jit
def _step_sum(w, sz, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, xs):
    """[BLOCK_N, 32] partial sums s * (sum q x - z sum x) * 2^-64 of one step's tile w [BLOCK_N, 32, 4]."""
    w_hi = (w.to(gl.uint32, bitcast=True) >> 16).to(gl.int32, bitcast=True)
    d = _plane(w, w_hi, 0) * xp0
    d += _plane(w, w_hi, 1) * xp1
    d += _plane(w, w_hi, 2) * xp2
    d += _plane(w, w_hi, 3) * xp3
    d += _plane(w, w_hi, 4) * xp4
    d += _plane(w, w_hi, 5) * xp5
    d += _plane(w, w_hi, 6) * xp6
    d += _plane(w, w_hi, 7) * xp7
    dsum = gl.sum(d, axis=2)
    s = (sz >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    z = (sz & 15).to(gl.float32)
    return s * (dsum - z * xs)


@gluon.jit
def _x_planes_direct(xb):
    """x's eight planes for a step, loaded from global memory (`xb`: plane 0's addresses), scaled by
    2^(85 - 4 (p % 4)), and their per-lane sums times 2^-64."""
    x0 = gl.load(xb).to(gl.float32)
    x1 = gl.load(xb + 16).to(gl.float32)
    x2 = gl.load(xb + 32).to(gl.float32)
    x3 = gl.load(xb + 48).to(gl.float32)
    x4 = gl.load(xb + 64).to(gl.float32)
    x5 = gl.load(xb + 80).to(gl.float32)
    x6 = gl.load(xb + 96).to(gl.float32)
    x7 = gl.load(xb + 112).to(gl.float32)
    xs = gl.sum(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), axis=2) * _DOWN
    return (x0 * _X_SCALE_0, x1 * _X_SCALE_1, x2 * _X_SCALE_2, x3 * _X_SCALE_3,
            x4 * _X_SCALE_0, x5 * _X_SCALE_1, x6 * _X_SCALE_2, x7 * _X_SCALE_3, xs)


@gluon.jit
def w4_pipe_kernel(x_ptr, qw_ptr, sz_ptr, out_ptr, N_OUT, stride_qw, stride_sz, UP, NPROG,
                   GPS: gl.constexpr, KS: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr,
                   STAGES: gl.constexpr, GATED: gl.constexpr, X_SMEM: gl.constexpr, KS_POW2: gl.constexpr,
                   PDL: gl.constexpr):
    L3: gl.constexpr = gl.BlockedLayout([BLOCK_N // WARPS, 1, 4], [1, 32, 1], [WARPS, 1, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    SH3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    SH2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    SH1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    pid = gl.program_id(0)
    blocks = gl.cdiv(N_OUT, BLOCK_N)
    n_iter = gl.cdiv(blocks - pid, NPROG) * KS
    r3, l3, j3 = _idx3(BLOCK_N, 32, 4, L3)
    r2 = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L2)), 1)
    l2 = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, L2)), 0)
    NB: gl.constexpr = 2 if GATED else 1                  # slots per stage: gate (and up) rows
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * NB, BLOCK_N, 32, 4], SH3)
    sz_smem = gl.allocate_shared_memory(gl.int32, [STAGES * NB, BLOCK_N, 32], SH2)
    # x index of plane 0 for lane l, int32 j of a step: chunk (l // 4), input 4 (l % 4) + j of each 16-input run
    x_base = (l3 // 4) * 128 + (l3 % 4) * 4 + j3
    acc_g = gl.zeros([BLOCK_N, 32], gl.float32, L2)
    acc_u = gl.zeros([BLOCK_N, 32], gl.float32, L2)
    if PDL:
        gdc_wait()
    if X_SMEM:
        # x's scaled planes and per-lane sums once per program, each [32, 4] plane of a step in the layout the steps
        # read it with: slot step * 8 + plane
        XL: gl.constexpr = gl.SliceLayout(0, L3)
        x_smem = gl.allocate_shared_memory(gl.float32, [KS_POW2 * 8, 32, 4], SH2)
        xs_smem = gl.allocate_shared_memory(gl.float32, [KS_POW2, 32], SH1)
        x_lane = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(1, XL)), 1)
        x_j = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, XL)), 0)
        for k in gl.static_range(KS):
            xb = x_ptr + (k * 8 + x_lane // 4) * 128 + (x_lane % 4) * 4 + x_j
            xsum = gl.zeros([32, 4], gl.float32, XL)
            for p in gl.static_range(8):
                xv = gl.load(xb + p * 16).to(gl.float32)
                xsum += xv
                x_smem.index(k * 8 + p).store(xv * (2.0 ** (85 - 4 * (p % 4))))
            xs_smem.index(k).store(gl.sum(xsum, axis=1) * _DOWN)
        gl.thread_barrier()
    for t in gl.static_range(STAGES - 1):
        _issue(t, n_iter, pid, NPROG, N_OUT, stride_qw, stride_sz, UP, qw_ptr, sz_ptr, w_smem, sz_smem, r3, l3, j3,
               r2, l2, GPS, KS, BLOCK_N, STAGES, GATED)
    for i in range(n_iter):
        _issue(i + STAGES - 1, n_iter, pid, NPROG, N_OUT, stride_qw, stride_sz, UP, qw_ptr, sz_ptr, w_smem, sz_smem,
               r3, l3, j3, r2, l2, GPS, KS, BLOCK_N, STAGES, GATED)
        ks = i % KS
        if X_SMEM:
            x0 = gl.expand_dims(x_smem.index(ks * 8 + 0).load(gl.SliceLayout(0, L3)), 0)
            x1 = gl.expand_dims(x_smem.index(ks * 8 + 1).load(gl.SliceLayout(0, L3)), 0)
            x2 = gl.expand_dims(x_smem.index(ks * 8 + 2).load(gl.SliceLayout(0, L3)), 0)
            x3 = gl.expand_dims(x_smem.index(ks * 8 + 3).load(gl.SliceLayout(0, L3)), 0)
            x4 = gl.expand_dims(x_smem.index(ks * 8 + 4).load(gl.SliceLayout(0, L3)), 0)
            x5 = gl.expand_dims(x_smem.index(ks * 8 + 5).load(gl.SliceLayout(0, L3)), 0)
            x6 = gl.expand_dims(x_smem.index(ks * 8 + 6).load(gl.SliceLayout(0, L3)), 0)
            x7 = gl.expand_dims(x_smem.index(ks * 8 + 7).load(gl.SliceLayout(0, L3)), 0)
            xs = gl.expand_dims(xs_smem.index(ks).load(gl.SliceLayout(0, L2)), 0)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7, xs = _x_planes_direct(x_ptr + ks * 1024 + x_base)
        async_copy.wait_group(STAGES - 1)
        slot = i % STAGES
        w = w_smem.index(slot * NB).load(L3)
        sz = sz_smem.index(slot * NB).load(L2)
        acc_g += _step_sum(w, sz, x0, x1, x2, x3, x4, x5, x6, x7, xs)
        if GATED:
            w = w_smem.index(slot * NB + 1).load(L3)
            sz = sz_smem.index(slot * NB + 1).load(L2)
            acc_u += _step_sum(w, sz, x0, x1, x2, x3, x4, x5, x6, x7, xs)
        if ks == KS - 1:
            g = gl.sum(acc_g, axis=1) * _UP
            if GATED:
                u = gl.sum(acc_u, axis=1) * _UP
                g = _round16(g)
                g = _round16(g / (1.0 + gl.exp(-g))) * _round16(u)
            rows = (pid + (i // KS) * NPROG) * BLOCK_N + gl.arange(0, BLOCK_N, layout=g.type.layout)
            gl.store(out_ptr + rows, g.to(gl.bfloat16), mask=rows < N_OUT)
            acc_g = gl.zeros([BLOCK_N, 32], gl.float32, L2)     # the next row block starts from zero
            acc_u = gl.zeros([BLOCK_N, 32], gl.float32, L2)
    async_copy.wait_group(0)
    if PDL:
        gdc_launch_dependents()


def pack_scale_zero(w: W4Weight) -> torch.Tensor:
    """[N, K/G] int32: the fp16 scale's bits << 16 | the zero point."""
    bits = w.scales.to(torch.float16).view(torch.int16).to(torch.int32)
    return (bits << 16) | w.zeros.to(torch.int32)


_SMS: dict[int, int] = {}


def w4_pipe_gemv(x: torch.Tensor, w: W4Weight, sz: torch.Tensor, gated: bool = False, block_n: int = 16,
                 warps: int = 4, stages: int = 4, per_sm: int = 3, x_smem: bool = True,
                 pdl: bool = True) -> torch.Tensor:
    """One bf16 row x [K] -> [N] (gated: [N/2] = silu(gate) * up), like `w4_gemv` without bias; `sz` from
    `pack_scale_zero(w)`."""
    k, n = w.in_features, w.out_features
    assert x.numel() == k and x.dtype == torch.bfloat16 and w.group_size % 128 == 0 and k % 1024 == 0
    n_out = n // 2 if gated else n
    dev = x.device.index or 0
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    ks = k // 1024
    nb = 2 if gated else 1
    smem = stages * nb * block_n * 640 + (triton.next_power_of_2(ks) * 4224 if x_smem else 0)
    per_sm = max(1, min(per_sm, (227 << 10) // (smem + 1024)))   # programs that fit in an SM's shared memory
    blocks = triton.cdiv(n_out, block_n)
    per_prog = triton.cdiv(blocks, _SMS[dev] * per_sm)       # row blocks per program, spread evenly
    nprog = triton.cdiv(blocks, per_prog)
    out = torch.empty(n_out, dtype=x.dtype, device=x.device)
    w4_pipe_kernel[(nprog,)](
        x.reshape(k), w.packed, sz, out, n_out, w.packed.stride(0), sz.stride(0), n_out if gated else 0, nprog,
        GPS=w.group_size // 128, KS=ks, BLOCK_N=block_n, WARPS=warps, STAGES=stages, GATED=gated, X_SMEM=x_smem,
        KS_POW2=triton.next_power_of_2(ks), PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out.reshape(*x.shape[:-1], n_out)


def compile_sm90(block_n: int = 16, warps: int = 4, stages: int = 4, gated: bool = False,
                 ks: int = 4, x_smem: bool = True) -> triton.compiler.CompiledKernel:
    """Compiled ahead of time for sm_90 (no GPU needed), to read its PTX / SASS / shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    args = {"x_ptr": "*bf16", "qw_ptr": "*i32", "sz_ptr": "*i32", "out_ptr": "*bf16", "N_OUT": "i32",
            "stride_qw": "i32", "stride_sz": "i32", "UP": "i32", "NPROG": "i32"}
    consts = dict(GPS=1, KS=ks, BLOCK_N=block_n, WARPS=warps, STAGES=stages, GATED=gated, X_SMEM=x_smem,
                  KS_POW2=triton.next_power_of_2(ks), PDL=True)
    signature = args | {name: "constexpr" for name in consts}
    attrs = {(w4_pipe_kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in args if a != "NPROG"}
    return triton.compile(GluonASTSource(fn=w4_pipe_kernel, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def install(configs: dict[str, list]) -> None:
    """Route the engine's one-row bf16 W4 linears without bias through the prototype. `configs` maps a kind ("short":
    K <= 4096, "gated": gate_up, "long": K > 4096) to [block_n, warps, stages, per_sm, x_smem]; a kind not in it keeps
    `w4_gemv`. The packed scale/zero words are made on first use per weight and cached."""
    from orinfer.kernels import w4_ops

    old = w4_ops.w4_gemv
    cache: dict[int, torch.Tensor] = {}

    def routed(x, w, bias=None, gated=False, cfg=None):
        kind = "gated" if gated else ("long" if w.in_features > 4096 else "short")
        c = configs.get(kind)
        if c is None or bias is not None or x.dtype != torch.bfloat16 or x.numel() != w.in_features:
            return old(x, w, bias, gated=gated, cfg=cfg)
        key = w.packed.data_ptr()
        if key not in cache:
            cache[key] = pack_scale_zero(w)
        return w4_pipe_gemv(x, w, cache[key], gated, block_n=c[0], warps=c[1], stages=c[2], per_sm=c[3],
                            x_smem=c[4])

    w4_ops.w4_gemv = routed
