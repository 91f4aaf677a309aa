"""x's int16 words made once, by the kernel that produces x, instead of by every program of the one-row INT4 GEMV.

The integer step of the batch-1 GEMV (`kernels/w4_int_step.py`) multiplies the nibbles by x rounded to int16 per
chunk of 128 inputs, packed in pairs for `dp2a`. Made inside the GEMV, every program repeats that x work for its
whole row: ~5 us of a Qwen3-8B layer's four GEMVs (30.6 against 35.7 us with the words made beforehand, H200).
Here the producer makes them in parallel, one program per chunk, and the GEMV only loads them
(`w4_gemv.w4_gemv_words`).

`W4Words` holds, for an activation x of K inputs (one row, 16-bit), in chunks of 8R = 128 inputs (C = K / 128):
  words  [4, K/8] int32   per int32 column c of the W4 layout (nibble p <-> input (c // R) 8R + c % R + p R), the
                          int16 pairs (v0, v2), (v4, v6), (v1, v3), (v5, v7), v_p = round(x_p f) (`w4_int_step`)
  meta   [3, C] fp32      per chunk: 1/f (nan where the chunk holds an inf or nan), the sum of its v, and for an
                          RMSNorm producer the chunk's sum of h^2 (not read otherwise)
  eps                     RMSNorm's epsilon, or None. With it the words stand for t = h * w (the norm's input times
                          its weight, exact in fp32), and the GEMV multiplies its sums by 1 / sqrt(mean(h^2) + eps)
                          from meta[2]: the norm needs no pass over the row after its reduction, so its C programs
                          run in parallel. Rounding: t is rounded once, to 16 bits per chunk, where the unfused path
                          rounds h / rms and then w * (h / rms) to the activation dtype (8 or 11 bits) before the
                          GEMV rounds that to 16 bits: the words path is closer to the exact product.

`rms_norm_words` is the producer for the RMSNorms in front of qkv and gate/up (with the residual add fused, as
`kernels/norm.py`). Grid (C,), one warp per chunk; traffic: read x, r, w (6 bytes per input), write r' and the words
(6 bytes per input).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device, interpreting
from orinfer.kernels.pdl import small_kernel_prologue, use_pdl
from orinfer.kernels.w4_int_step import _words_of, _x_plane_loads

CHUNK = 128   # inputs per chunk (R = 16 int32: the W4 layout's chunk at group sizes that are multiples of 128)
R = CHUNK // 8


class W4Words(NamedTuple):
    words: torch.Tensor        # [4, K/8] int32
    meta: torch.Tensor         # [3, K/128] fp32: 1/f (nan: non-finite chunk), sum of v, an RMSNorm's sums of h^2
    dtype: torch.dtype         # the activation's dtype (the GEMV's output dtype)
    shape: tuple[int, ...]     # the activation's shape [..., K] (one row)
    eps: float | None = None   # RMSNorm's epsilon: the consumer applies 1 / rms; None: the words are x itself

    @property
    def in_features(self) -> int:
        return self.words.shape[1] * 8


def words_fit(x: torch.Tensor, group_size: int) -> bool:
    """Whether an activation `x` for a W4 linear of this group size can come as words: one row of 16-bit values, K
    and the group size multiples of 128 (the GEMV's chunk is then the words' chunk). The device is the backend's
    concern (only the triton backend makes words)."""
    return (x.dtype in (torch.bfloat16, torch.float16) and x.numel() == x.shape[-1]
            and x.shape[-1] % CHUNK == 0 and group_size % CHUNK == 0)


def words_ref(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(words [4, K/8] int32, 1/f [C], sum of v [C]) of fp32 values t [K] (`w4_int_step`'s math in torch)."""
    tc = t.float().reshape(-1, 8, R)                                   # [chunk, plane p, int32 column within chunk]
    amax = tc.abs().amax(dim=(1, 2))
    e = (amax.view(torch.int32) >> 23).clamp(15, 254)
    f = ((268 - e) << 23).view(torch.float32)                          # 2^(14 - (e - 127))
    inv_f = ((e - 14) << 23).view(torch.float32)
    inv_f = torch.where(torch.isfinite(amax), inv_f, torch.full_like(inv_f, float("nan")))
    v = torch.round(tc * f[:, None, None]).to(torch.int32)             # half to even, as the kernels' magic add
    v_sum = v.sum(dim=(1, 2)).float()
    lo = v & 0xFFFF
    pairs = [(lo[:, a] | (v[:, b] << 16)).reshape(-1) for a, b in ((0, 2), (4, 6), (1, 3), (5, 7))]
    return torch.stack(pairs).contiguous(), inv_f, v_sum


def rms_norm_words_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                       ) -> W4Words | tuple[W4Words, torch.Tensor]:
    """`rms_norm_words`'s result in torch: h = x (+ residual, rounded to x's dtype), words of h * w, sums of h^2."""
    if residual is not None:
        x = x + residual
    h = x.reshape(-1).float()
    words, inv_f, v_sum = words_ref(h * weight.float())
    sq = (h * h).reshape(-1, CHUNK).sum(dim=1)
    out = W4Words(words, torch.stack([inv_f, v_sum, sq]), x.dtype, tuple(x.shape), eps)
    return out if residual is None else (out, x)


@triton.jit
def _residual_plane(x, r, res_ptr, offs, HAS_RES: tl.constexpr):
    """h = x (+ r, rounded to the residual's dtype as the unfused add rounds it, and stored as the new residual)."""
    if HAS_RES:
        h = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + offs, h)
        return h.to(tl.float32)
    return x


@triton.jit
def _rms_norm_words_kernel(x_ptr, r_ptr, w_ptr, res_ptr, words_ptr, meta_ptr, K8, C, R: tl.constexpr,
                           HAS_RES: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py
        small_kernel_prologue()
    chunk = tl.program_id(0)
    col = chunk * R + tl.arange(0, R)                 # the chunk's int32 columns
    offs = chunk * (8 * R) + tl.arange(0, R)          # their nibble-0 inputs; plane p: + p R
    # Every load before the first store: the compiler cannot tell the residual store from the inputs, so a store
    # between them would serialise the planes' round trips to memory (~2 us more per call).
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_plane_loads(x_ptr, offs, R)
    r0, r1, r2, r3, r4, r5, r6, r7 = _x_plane_loads(r_ptr, offs, R)
    w0, w1, w2, w3, w4, w5, w6, w7 = _x_plane_loads(w_ptr, offs, R)
    h0 = _residual_plane(x0, r0, res_ptr, offs, HAS_RES)
    h1 = _residual_plane(x1, r1, res_ptr, offs + R, HAS_RES)
    h2 = _residual_plane(x2, r2, res_ptr, offs + 2 * R, HAS_RES)
    h3 = _residual_plane(x3, r3, res_ptr, offs + 3 * R, HAS_RES)
    h4 = _residual_plane(x4, r4, res_ptr, offs + 4 * R, HAS_RES)
    h5 = _residual_plane(x5, r5, res_ptr, offs + 5 * R, HAS_RES)
    h6 = _residual_plane(x6, r6, res_ptr, offs + 6 * R, HAS_RES)
    h7 = _residual_plane(x7, r7, res_ptr, offs + 7 * R, HAS_RES)
    # h * w is exact in fp32 (two 16-bit values)
    v0, v1, v2, v3, inv_f, v_sum, guard = _words_of(h0 * w0, h1 * w1, h2 * w2, h3 * w3, h4 * w4, h5 * w5, h6 * w6,
                                                    h7 * w7, R, 1, ASM)
    tl.store(words_ptr + col, v0)
    tl.store(words_ptr + K8 + col, v1)
    tl.store(words_ptr + 2 * K8 + col, v2)
    tl.store(words_ptr + 3 * K8 + col, v3)
    one = chunk + tl.arange(0, 1)
    tl.store(meta_ptr + one, inv_f + guard)
    tl.store(meta_ptr + C + one, v_sum)
    sq = ((h0 * h0 + h1 * h1) + (h2 * h2 + h3 * h3)) + ((h4 * h4 + h5 * h5) + (h6 * h6 + h7 * h7))
    tl.store(meta_ptr + 2 * C + chunk, tl.sum(sq, axis=0))


def rms_norm_words(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> W4Words | tuple[W4Words, torch.Tensor]:
    """`kernels.norm.rms_norm` for a W4 GEMV consumer (`words_fit`): the words of h * w instead of the normed row
    (module docstring), and the new residual h = x + residual when one is given."""
    check_device(x)
    k = x.shape[-1]
    if x.numel() != k or k % CHUNK or weight.shape != (k,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm_words takes one row of a multiple of {CHUNK} inputs and a matching weight and "
                         f"residual, got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    x1 = x.reshape(k).contiguous()
    chunks = k // CHUNK
    words = torch.empty(4, k // 8, dtype=torch.int32, device=x.device)
    meta = torch.empty(3, chunks, dtype=torch.float32, device=x.device)
    res = torch.empty_like(x1) if residual is not None else x1
    pdl = use_pdl(x1)
    _rms_norm_words_kernel[(chunks,)](
        x1, residual.reshape(k).contiguous() if residual is not None else x1, weight.contiguous(), res, words, meta,
        k // 8, chunks, R=R, HAS_RES=residual is not None, ASM=not interpreting(), PDL=pdl, num_warps=1,
        launch_pdl=pdl)
    out = W4Words(words, meta, x.dtype, tuple(x.shape), eps)
    return out if residual is None else (out, res.view(x.shape))

