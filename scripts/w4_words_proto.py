"""Prototype (session 12): the integer one-row W4 GEMV step with x's int16 words made once, beforehand, instead of by
every program (`w4_int_step._x_words`). Measures what a producer that writes the words (the RMSNorm kernel before qkv
and gate_up, the split combine before o: one head = one 128-input chunk) would save the GEMVs. `prepare_words` is a
torch version of `_x_words`'s math: words [4, K/8] int32 (pairs (v0, v2), (v4, v6), (v1, v3), (v5, v7) per int32
column), and per chunk of 8R inputs 1/f and the sum of v (nan in 1/f when the chunk is not finite)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.pdl import gdc_launch_dependents, gdc_wait, use_pdl
from orinfer.kernels.w4 import W4Weight
from orinfer.kernels.w4_gemv import W4GemvConfig, _epilogue, _load_tiles, _tile_groups
from orinfer.kernels.w4_int_step import _rows_step


def prepare_words(x: torch.Tensor, r: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = x.numel()
    xc = x.float().reshape(k // (8 * r), 8, r)                        # [chunk, plane p, int32 column within chunk]
    amax = xc.abs().amax(dim=(1, 2))
    e = ((amax.view(torch.int32) >> 23).clamp(15, 254))
    f = ((268 - e) << 23).view(torch.float32)
    inv_f = ((e - 14) << 23).view(torch.float32)
    v = torch.round(xc * f[:, None, None]).to(torch.int32)            # round half to even, as the kernel's add
    sv = v.sum(dim=(1, 2)).float()
    inv_f = torch.where(torch.isfinite(amax), inv_f, torch.full_like(inv_f, float("nan")))
    lo = v & 0xFFFF
    pair = lambda a, b: (lo[:, a] | (v[:, b] << 16)).reshape(-1)     # noqa: E731  [chunk * r] per column c
    words = torch.stack([pair(0, 2), pair(4, 6), pair(1, 3), pair(5, 7)])
    return words.contiguous(), inv_f, sv


@triton.jit
def _words_kernel(xw_ptr, inv_ptr, sv_ptr, qw_ptr, sc_ptr, zp_ptr, out_ptr, N_OUT, K8, stride_qw, stride_sg, UP,
                  G8: tl.constexpr, R: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_KP: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr):
    CHUNKS: tl.constexpr = BLOCK_KP // R
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ld = tl.minimum(rows, N_OUT - 1).to(tl.int64)
    cols = tl.arange(0, BLOCK_KP)
    chunks = tl.arange(0, CHUNKS)
    wg_ptrs = qw_ptr + r_ld[:, None] * stride_qw + cols[None, :]
    acc_g = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    if PDL:
        gdc_wait()
    for i in tl.static_range(STEPS):
        c0 = i * BLOCK_KP
        ch = c0 // R + chunks
        xw = (tl.load(xw_ptr + c0 + cols), tl.load(xw_ptr + K8 + c0 + cols), tl.load(xw_ptr + 2 * K8 + c0 + cols),
              tl.load(xw_ptr + 3 * K8 + c0 + cols), tl.load(inv_ptr + ch), tl.load(sv_ptr + ch),
              tl.zeros([CHUNKS], dtype=tl.float32))
        sg = r_ld[:, None] * stride_sg + ((c0 + chunks * R) // G8)[None, :]
        w_g, w_u = _load_tiles(wg_ptrs, c0, UP * stride_qw, GATED)
        acc_g = _rows_step(acc_g, w_g, xw, sc_ptr, zp_ptr, sg, BLOCK_N, BLOCK_KP, R, True)
        if GATED:
            acc_u = _rows_step(acc_u, w_u, xw, sc_ptr + UP * stride_sg, zp_ptr + UP * stride_sg, sg, BLOCK_N,
                               BLOCK_KP, R, True)
    if PDL:
        gdc_launch_dependents()
    out = _epilogue(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), 0.0, out_ptr.dtype.element_ty, False, GATED, False)
    tl.store(out_ptr + rows, out, mask=rows < N_OUT)


def w4_words_gemv(words: tuple, w: W4Weight, gated: bool, cfg: W4GemvConfig,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    xw, inv_f, sv = words
    k, n = w.in_features, w.out_features
    n_out = n // 2 if gated else n
    block_kp, _, _ = _tile_groups(k // 8, w.group_size // 8, w.chunk_int32, cfg.block_kp)
    out = torch.empty(n_out, dtype=dtype, device=xw.device)
    pdl = use_pdl(xw)
    _words_kernel[(triton.cdiv(n_out, cfg.block_n),)](
        xw, inv_f, sv, w.packed, w.scales, w.zeros, out, n_out, k // 8, w.packed.stride(0), w.scales.stride(0),
        n_out if gated else 0, G8=w.group_size // 8, R=w.chunk_int32, GATED=gated, BLOCK_N=cfg.block_n,
        BLOCK_KP=block_kp, STEPS=k // 8 // block_kp, PDL=pdl, num_warps=cfg.num_warps, launch_pdl=pdl)
    return out
