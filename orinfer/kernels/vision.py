"""Kernels of the Qwen3-VL vision tower (seed 002's fused set), with their pure-torch references.

The tower runs on every patch of every image at once, so its ops are row-wise over [N, D] tensors (N patches, D
the vision width) plus an attention kept within each image. Each public op has a `*_ref` with the same signature;
the references define the math (fp32 inside, one rounding to the activation dtype at the end, as HF does).

Ops (shapes; all activations share one dtype, weights/biases may be 16-bit):
- layer_norm(x [N, D], weight [D], bias [D], eps) -> [N, D]: LayerNorm with bias, fp32 mean/variance.
- bias_gelu(x [N, D], bias [D], approximate) -> gelu(x + bias): after a bias-free GEMM; approximate "tanh"
  (the blocks' gelu_pytorch_tanh) or "none" (the mergers' exact erf GELU).
- bias_residual(x [N, D], bias [D], residual [N, D]) -> x + bias + residual (the block's output projections).
- qkv_split_rope(qkv [N, 3*H*Dh], cos [N, Dh/2], sin [N, Dh/2], num_heads) -> q, k, v each [H, N, Dh], stored
  token-major (each the transposed view of a contiguous [N, H, Dh]): splits the packed projection and rotates q
  and k (rotate-half convention over the full head: out[:h] = x1*c - x2*s, out[h:] = x2*c + x1*s with h = Dh/2,
  in fp32). Token-major storage is what cuDNN's attention reads as is (BSHD), and its output then is [N, H, Dh]
  already: no transposing copy after it (151 us against 154 with head-major inputs and the copy, H200).
- vision_attention(q, k, v [H, N, Dh], cu_seqlens [B+1] int32, max_seqlen, scale) -> [N, H*Dh]: softmax
  attention without a causal mask, each token seeing only the tokens of its own segment (image).

Triton versions (same names without `_ref`, same signatures, same rounding points): one private `@triton.jit`
kernel each, all fp32 inside. Qwen3-VL-8B shapes for one 1024x768 image: N = 64*48 = 3072 patches, D = 1152,
MLP intermediate 4304, H = 16 heads of Dh = 72; the figures in the docstrings are for bf16 on an H200 (4.1 TB/s).
The norms and the bias epilogues are pure bandwidth: their target is bytes moved / read bandwidth. Attention is
compute-bound (2 * 2*N^2*H*Dh flops per image).

Decisions:
- Spatial merge: no kernel. Seed 002's `spatial_merge_fp16_kernel` copied [N, D] into [N/4, 4D] with the index map
  out[t*4D + p*D + c] = in[(4t + p)*D + c], i.e. the identity on the flat buffer: a memcpy. In Qwen3-VL the image
  processor already emits patches so that each 2x2 merge window is 4 consecutive rows, so the merger's reshape is
  a free view of a contiguous tensor and the copy simply disappears. What is left around it is a LayerNorm
  (the main merger norms each patch over D before the view; the deepstack mergers, `use_postshuffle_norm`, norm
  over the 4D concatenation after it, which is `layer_norm` on the [N/4, 4D] view), then fc1 -> exact GELU -> fc2,
  whose fc1 epilogue is `bias_gelu(approximate="none")` and whose fc2 bias can stay in cuBLAS's epilogue. There is
  nothing left to fuse that is not already one of the ops here.
- Attention: a separate kernel here rather than a CAUSAL switch on kernels/attention.py's varlen prefill kernel.
  (1) Dh = 72 is not a power of two: that kernel pads the head to next_pow2 = 128, so its tensor-core dots do
  128/72 = 1.78x the needed work. This one splits the head into a power-of-two tile and a small remainder tile
  (72 = 64 + 16, the 16 masked to 8: 80 lanes, 1.6x less work than 128), i.e. two dots per product and two
  accumulators; putting that into the shared kernel would touch every line of the causal path, which the text
  model's prefill depends on. (2) The loop is simpler: all full key tiles unmasked, one masked tail tile per
  segment, no diagonal. (3) GQA and the causal block ordering are not needed. Layouts are free through strides:
  q/k/v as `qkv_split_rope` stores them (token-major: a key tile is BLOCK_N runs of Dh) and the output written
  token-major [N, H*Dh] directly, which removes the seed's separate `transpose_head_token_kernel`.
- No PDL (kernels/pdl.py): the tower runs once per image in eager mode, not in the decode loop PDL serves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device, interpreting

_LOG2E = 1.4426950408889634
MAX_FEATURES = 65536  # layer_norm keeps one row in registers; wider rows fall back to the reference
_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- references ------------------------------------------------------------------------------------------------------

def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim in fp32 (biased variance), affine with `weight` and `bias`, rounded once to x's
    dtype. x [..., D], weight/bias [D] (any float dtype: mixed mode keeps fp32 activations with 16-bit weights)."""
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return y.to(x.dtype)


def bias_gelu_ref(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(x + bias) in fp32; the bias add is rounded to x's dtype first, as an unfused Linear would.
    x [..., D], bias [D]; approximate "tanh" or "none" (erf)."""
    return F.gelu((x + bias.to(x.dtype)).float(), approximate=approximate).to(x.dtype)


def bias_residual_ref(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + (x + bias), with the same two roundings as Linear(bias) followed by the residual add.
    x, residual [..., D] of one dtype, bias [D]."""
    return residual + (x + bias.to(x.dtype))


def qkv_split_rope_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed [N, 3*H*Dh] -> rotated q, k and plain v, each [H, N, Dh] stored token-major (see the module
    docstring). cos, sin [N, Dh/2] (any float dtype, used as given: widened to fp32, not rounded to qkv's dtype)."""
    tokens = qkv.shape[0]
    q, k, v = qkv.view(tokens, 3, num_heads, -1).unbind(1)  # each [N, H, Dh]
    c = torch.cat([cos, cos], dim=-1).float()[:, None, :]
    s = torch.cat([sin, sin], dim=-1).float()[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * c + rotated * s).to(x.dtype)

    return rotate(q).transpose(0, 1), rotate(k).transpose(0, 1), v.contiguous().transpose(0, 1)


def vision_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int | None, scale: float, bounds: Sequence[int] | None = None) -> torch.Tensor:
    """Bidirectional attention within each segment [cu[i], cu[i+1]); fp32 softmax; returns [N, H*Dh].
    q, k, v [H, N, Dh]; rows outside every segment are left unwritten; max_seqlen is not needed here; `bounds`, when
    given, are cu_seqlens' values on the host (saves a device-to-host copy)."""
    heads, tokens, head_dim = q.shape
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist() if bounds is None else list(bounds)
    for begin, end in zip(bounds[:-1], bounds[1:]):
        if end <= begin:
            continue
        qs, ks, vs = (t[:, begin:end].float() for t in (q, k, v))
        probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[begin:end] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return out.view(tokens, heads * head_dim)


def default_scale(head_dim: int) -> float:
    """The attention's softmax scale 1/sqrt(Dh)."""
    return 1.0 / math.sqrt(head_dim)


# --- shared wrapper helpers ------------------------------------------------------------------------------------------

def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """t [..., D] as a 2-D [rows, D] tensor with unit last stride (a view when the layout allows, else a copy);
    the row stride is passed to the kernels, so column slices of a wider buffer are read in place."""
    if t.dtype not in _ACT_DTYPES:
        raise ValueError(f"{name}: unsupported dtype {t.dtype}")
    t2 = t.unsqueeze(0) if t.dim() == 1 else t.reshape(-1, t.shape[-1]) if t.dim() > 2 else t
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def _vector(t: torch.Tensor, size: int, name: str) -> torch.Tensor:
    if t.shape != (size,) or not t.is_floating_point():
        raise ValueError(f"{name}: expected a float vector of {size}, got {tuple(t.shape)} {t.dtype}")
    return t.contiguous()


def _epilogue_tiles(rows: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) for the row-wise bias epilogues: 4096-element tiles (16 per thread over 8 warps,
    i.e. two 16-byte vectors per 16-bit operand), with the column block the widest power of two in [128, 1024] that
    wastes at most 1/8 of the lanes on the ragged last block (D = 1152 -> 128, 4304 -> 256, 4608 -> 512)."""
    block_c = triton.next_power_of_2(cols) if cols < 128 else 128
    for c in (1024, 512, 256):
        if triton.cdiv(cols, c) * c * 8 <= cols * 9:
            block_c = c
            break
    block_r = max(1, min(triton.next_power_of_2(rows), 4096 // block_c))
    return block_r, block_c, max(1, min(8, block_r * block_c // 512))


# --- Triton: LayerNorm -----------------------------------------------------------------------------------------------

@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n_rows, stride_x, eps,
                       D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    # Two passes over the registers (mean, then centred squares): as exact as the reference's, and the padding
    # lanes must be zeroed after centring or each would add mean^2 to the variance.
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton `layer_norm_ref`: y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim, fp32 inside,
    one rounding to x's dtype.

    x [..., D] (unit last stride; the row stride of a 2-D x is free), weight/bias [D] of any float dtype -> a new
    contiguous tensor of x's shape and dtype. Also the mergers' post-shuffle norm: x is then the free [N/4, 4D]
    view (see the module docstring). Kernel: grid (cdiv(rows, ROWS),); a program holds ROWS rows of
    BLOCK_D = next_pow2(D) features in registers (ROWS = 1 for D >= 2048; 16 elements per thread at D = 1152 with
    4 warps and D = 4608 with 16), two-pass fp32 mean and variance. D > MAX_FEATURES falls back to the reference.
    Traffic: read x, write y (2*rows*D elements) + 2*D: bf16 [3072, 1152] is 14.2 MB, 3.4 us at 4.1 TB/s.
    """
    check_device(x)
    d = x.shape[-1]
    weight, bias = _vector(weight, d, "layer_norm weight"), _vector(bias, d, "layer_norm bias")
    x2 = _rows(x, "layer_norm")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or d == 0:
        return out
    if d > MAX_FEATURES:
        return layer_norm_ref(x, weight, bias, eps)
    block_d = triton.next_power_of_2(d)
    rows_per_prog = max(1, min(16, 2048 // block_d))
    warps = max(1, min(16, rows_per_prog * block_d // 512))
    _layer_norm_kernel[(triton.cdiv(x2.shape[0], rows_per_prog),)](
        x2, weight, bias, out, x2.shape[0], x2.stride(0), eps,
        D=d, ROWS=rows_per_prog, BLOCK_D=block_d, num_warps=warps)
    return out


# --- Triton: bias + GELU, bias + residual ----------------------------------------------------------------------------

@triton.jit
def _biased_tile(x_ptr, b_ptr, n_rows, n_cols, stride_x, act_ty: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """This program's [BLOCK_R, BLOCK_C] tile of x + bias as fp32, with its rows, columns and mask. Rounded where
    the reference rounds: bias.to(x.dtype), then the Linear's output x + bias to the activation dtype."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(act_ty).to(tl.float32)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return (x + b[None, :]).to(act_ty).to(tl.float32), rows, cols, mask


@triton.jit
def _bias_gelu_kernel(x_ptr, b_ptr, out_ptr, n_rows, n_cols, stride_x,
                      TANH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    act_ty = out_ptr.dtype.element_ty
    h, rows, cols, mask = _biased_tile(x_ptr, b_ptr, n_rows, n_cols, stride_x, act_ty, BLOCK_R, BLOCK_C)
    if TANH:
        # 0.5*h*(1 + tanh(u)) == h * sigmoid(2u): one exp, no tanh, and no cancellation in 1 + tanh(u) for u << 0
        # (exp overflows to inf there and the quotient is the correct -0).
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)  # sqrt(2/pi) * (h + 0.044715 h^3)
        y = h / (1.0 + tl.exp(-2.0 * u))
    else:
        y = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))  # exact: erf(h / sqrt(2))
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], y.to(act_ty), mask=mask)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """Triton `bias_gelu_ref`: gelu(round(x + bias)) in fp32, rounded once more to x's dtype.

    GELU "tanh": h * sigmoid(2 * sqrt(2/pi) * (h + 0.044715 h^3)) (== 0.5 h (1 + tanh(...))); "none":
    0.5 h (1 + erf(h / sqrt(2))). x [..., D] (unit last stride; a 2-D x's row stride is free), bias [D] -> new
    contiguous tensor like x. Kernel: grid (cdiv(rows, BLOCK_R), cdiv(D, BLOCK_C)), 4096-element tiles, 8 warps
    (`_epilogue_tiles`); the bias slice is loaded once per tile. Traffic: read x, write y = 2*rows*D elements + D
    (bf16 [3072, 4304]: 52.9 MB, 12.9 us at 4.1 TB/s), versus 4*rows*D for the add and the GELU as two kernels.
    """
    check_device(x)
    if approximate not in ("tanh", "none"):
        raise ValueError(f"bias_gelu: approximate must be 'tanh' or 'none', got {approximate!r}")
    d = x.shape[-1]
    bias = _vector(bias, d, "bias_gelu bias")
    x2 = _rows(x, "bias_gelu")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or d == 0:
        return out
    block_r, block_c, warps = _epilogue_tiles(x2.shape[0], d)
    _bias_gelu_kernel[(triton.cdiv(x2.shape[0], block_r), triton.cdiv(d, block_c))](
        x2, bias, out, x2.shape[0], d, x2.stride(0),
        TANH=approximate == "tanh", BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


@triton.jit
def _bias_residual_kernel(x_ptr, b_ptr, r_ptr, out_ptr, n_rows, n_cols, stride_x, stride_r,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    act_ty = out_ptr.dtype.element_ty
    h, rows, cols, mask = _biased_tile(x_ptr, b_ptr, n_rows, n_cols, stride_x, act_ty, BLOCK_R, BLOCK_C)
    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], (h + r).to(act_ty), mask=mask)


def bias_residual(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Triton `bias_residual_ref`: residual + round(x + bias), rounded to x's dtype (fp32 adds, two roundings).

    x, residual [..., D] of one dtype (unit last stride; 2-D row strides free), bias [D] -> new contiguous tensor
    like x; nothing is written in place. Kernel: as `bias_gelu` (`_epilogue_tiles`). Traffic: read x and residual,
    write the sum = 3*rows*D elements + D (bf16 [3072, 1152]: 21.2 MB, 5.2 us at 4.1 TB/s), versus 5*rows*D for
    the bias add and the residual add as two kernels.
    """
    check_device(x)
    d = x.shape[-1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"bias_residual: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must match")
    bias = _vector(bias, d, "bias_residual bias")
    x2, r2 = _rows(x, "bias_residual"), _rows(residual, "bias_residual")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or d == 0:
        return out
    block_r, block_c, warps = _epilogue_tiles(x2.shape[0], d)
    _bias_residual_kernel[(triton.cdiv(x2.shape[0], block_r), triton.cdiv(d, block_c))](
        x2, bias, r2, out, x2.shape[0], d, x2.stride(0), r2.stride(0),
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


# --- Triton: QKV split + RoPE + transpose ----------------------------------------------------------------------------

@triton.jit
def _qkv_split_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, n_tokens, stride_qkv, stride_cos,
                           stride_sin, HALF: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    # The program's elements are flat (token, head, j) triples, j < HALF = Dh/2: all BLOCK lanes do work whatever
    # Dh is (a [tokens, next_pow2(36) = 64] tile would idle 44% of them), each carries both rotation partners, and
    # consecutive lanes read consecutive q (k, v) elements of a token and write consecutive [N, H, Dh] elements.
    HEADS: tl.constexpr = WIDTH // (2 * HALF)
    idx = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = idx < n_tokens * (HEADS * HALF)
    t = idx // (HEADS * HALF)
    hj = idx % (HEADS * HALF)
    j = hj % HALF
    src = qkv_ptr + t * stride_qkv + (hj // HALF) * (2 * HALF) + j  # q of head hj // HALF; k, v WIDTH further on
    c = tl.load(cos_ptr + t * stride_cos + j, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin + j, mask=mask, other=0.0).to(tl.float32)
    dst = (t * HEADS + hj // HALF) * (2 * HALF) + j  # [N, H, Dh] contiguous
    act_ty = q_ptr.dtype.element_ty
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + dst, (x1 * c - x2 * s).to(act_ty), mask=mask)
    tl.store(q_ptr + dst + HALF, (x2 * c + x1 * s).to(act_ty), mask=mask)
    x1 = tl.load(src + WIDTH, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + WIDTH + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(k_ptr + dst, (x1 * c - x2 * s).to(act_ty), mask=mask)
    tl.store(k_ptr + dst + HALF, (x2 * c + x1 * s).to(act_ty), mask=mask)
    tl.store(v_ptr + dst, tl.load(src + 2 * WIDTH, mask=mask), mask=mask)  # v: a plain copy, bit for bit
    tl.store(v_ptr + dst + HALF, tl.load(src + 2 * WIDTH + HALF, mask=mask), mask=mask)


def qkv_split_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `qkv_split_rope_ref`: one pass from the packed projection to rotated q, k and v.

    qkv [N, 3*H*Dh] (unit last stride, row stride free), cos/sin [N, Dh/2] (any float dtype, unit last stride)
    -> q, k, v: [H, N, Dh] in qkv's dtype, each the transposed view of a new contiguous [N, H, Dh]. q/k:
    (x1*c - x2*s, x2*c + x1*s) in fp32, one rounding; v copied exactly. Kernel: grid (cdiv(N*H*Dh/2, BLOCK),) with
    BLOCK = 1024 (token, head, j) triples and 4 warps; a program reads the 6 values (q, k, v halves) and cos/sin of
    each triple and writes a contiguous run of BLOCK*2 elements in each output. Traffic: 6*N*H*Dh elements (read
    qkv, write q/k/v) + N*Dh cos/sin (L1/L2 hits for all heads but the first): bf16 N = 3072 is 42.5 MB + 0.9 MB
    fp32 cos/sin, 10.6 us at 4.1 TB/s; the unfused split -> rotate -> transpose sequence moves several times that.
    """
    check_device(qkv)
    if qkv.dim() != 2 or qkv.dtype not in _ACT_DTYPES or num_heads <= 0 or qkv.shape[1] % (3 * num_heads):
        raise ValueError(f"qkv_split_rope: qkv {tuple(qkv.shape)} {qkv.dtype} is not [N, 3*{num_heads}*Dh]")
    tokens, head_dim = qkv.shape[0], qkv.shape[1] // (3 * num_heads)
    half = head_dim // 2
    if head_dim % 2 or cos.shape != (tokens, half) or sin.shape != (tokens, half):
        raise ValueError(f"qkv_split_rope: head_dim {head_dim} must be even and cos {tuple(cos.shape)}, sin "
                         f"{tuple(sin.shape)} be [{tokens}, {half}]")
    if not (cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError("qkv_split_rope: cos and sin must be floating point")
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q, k, v = (torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device).transpose(0, 1)
               for _ in range(3))
    if tokens == 0 or head_dim == 0:
        return q, k, v
    block = 1024
    _qkv_split_rope_kernel[(triton.cdiv(tokens * num_heads * half, block),)](
        qkv, cos, sin, q, k, v, tokens, qkv.stride(0), cos.stride(0), sin.stride(0),
        HALF=half, WIDTH=num_heads * head_dim, BLOCK=block, num_warps=4)
    return q, k, v


# --- Triton: non-causal flash attention over segments ----------------------------------------------------------------

@triton.jit
def _mma(a, b, DOT_F32: tl.constexpr):
    """a @ b with fp32 accumulation: exact fp32 ("ieee") for fp32 inputs, else tensor cores in b's dtype."""
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(b.dtype), b)
    return out


@triton.jit
def _segment_tile(q_lo, q_hi, m_i, l_i, acc_lo, acc_hi, k_base, v_base, keys, length, d_lo, d_hi,
                  stride_kt, stride_vt, scale_log2,
                  D: tl.constexpr, SPLIT: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr):
    """One key tile of the online softmax: updates (m_i, l_i, acc_lo, acc_hi) with the segment's keys [BLOCK_N].
    MASKED: the tile may run past the segment's end (its last tile); the others are full and need no key mask."""
    key_rows = keys[:, None].to(tl.int64)
    lo_mask = (d_lo < D)[None, :]
    hi_mask = (d_hi < D)[None, :]
    if MASKED:
        lo_mask = lo_mask & (keys < length)[:, None]
        hi_mask = hi_mask & (keys < length)[:, None]
    k = tl.load(k_base + key_rows * stride_kt + d_lo[None, :], mask=lo_mask, other=0.0)
    s = _mma(q_lo, tl.trans(k), DOT_F32)
    if SPLIT:
        k = tl.load(k_base + key_rows * stride_kt + d_hi[None, :], mask=hi_mask, other=0.0)
        s += _mma(q_hi, tl.trans(k), DOT_F32)
    s = s * scale_log2
    if MASKED:
        s = tl.where((keys < length)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds >= 1 key of the segment
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + key_rows * stride_vt + d_lo[None, :], mask=lo_mask, other=0.0)
    acc_lo = acc_lo * alpha[:, None] + _mma(p, v, DOT_F32)
    if SPLIT:
        v = tl.load(v_base + key_rows * stride_vt + d_hi[None, :], mask=hi_mask, other=0.0)
        acc_hi = acc_hi * alpha[:, None] + _mma(p, v, DOT_F32)
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _vision_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, scale_log2,
                             stride_qh, stride_qt, stride_kh, stride_kt, stride_vh, stride_vt, stride_ot, stride_oh,
                             D: tl.constexpr, D_LO: tl.constexpr, D_HI: tl.constexpr, SPLIT: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    seg = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    start = tl.load(cu_ptr + seg)
    length = tl.load(cu_ptr + seg + 1) - start
    if m0 < length:  # blocks past a shorter segment's end (the grid is sized for the longest) do nothing
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        d_lo = tl.arange(0, D_LO)
        d_hi = D_LO + tl.arange(0, D_HI)  # only read when SPLIT (D_HI is then the remainder's tile width)
        m_mask = offs_m < length
        rows = (start + offs_m).to(tl.int64)
        q_rows = q_ptr + h * stride_qh + rows[:, None] * stride_qt
        q_lo = tl.load(q_rows + d_lo[None, :], mask=m_mask[:, None] & (d_lo < D)[None, :], other=0.0)
        acc_lo = tl.zeros([BLOCK_M, D_LO], dtype=tl.float32)
        if SPLIT:
            q_hi = tl.load(q_rows + d_hi[None, :], mask=m_mask[:, None] & (d_hi < D)[None, :], other=0.0)
            acc_hi = tl.zeros([BLOCK_M, D_HI], dtype=tl.float32)
        else:  # placeholders with the right types, passed through untouched
            q_hi = q_lo
            acc_hi = acc_lo
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        k_base = k_ptr + h * stride_kh + start.to(tl.int64) * stride_kt
        v_base = v_ptr + h * stride_vh + start.to(tl.int64) * stride_vt
        full = length - length % BLOCK_N
        for n0 in range(0, full, BLOCK_N):
            m_i, l_i, acc_lo, acc_hi = _segment_tile(
                q_lo, q_hi, m_i, l_i, acc_lo, acc_hi, k_base, v_base, n0 + offs_n, length, d_lo, d_hi,
                stride_kt, stride_vt, scale_log2, D, SPLIT, False, DOT_F32)
        for n0 in range(full, length, BLOCK_N):  # the ragged last tile, if any: at most one iteration
            m_i, l_i, acc_lo, acc_hi = _segment_tile(
                q_lo, q_hi, m_i, l_i, acc_lo, acc_hi, k_base, v_base, n0 + offs_n, length, d_lo, d_hi,
                stride_kt, stride_vt, scale_log2, D, SPLIT, True, DOT_F32)
        out_ty = out_ptr.dtype.element_ty
        o_rows = out_ptr + h * stride_oh + rows[:, None] * stride_ot  # token-major [N, H*Dh]: fused transpose
        tl.store(o_rows + d_lo[None, :], (acc_lo / l_i[:, None]).to(out_ty),
                 mask=m_mask[:, None] & (d_lo < D)[None, :])
        if SPLIT:
            tl.store(o_rows + d_hi[None, :], (acc_hi / l_i[:, None]).to(out_ty),
                     mask=m_mask[:, None] & (d_hi < D)[None, :])


def head_split(head_dim: int) -> tuple[int, int]:
    """(D_LO, D_HI): the head dim as a power-of-two tile plus a remainder tile (D_HI = 0: one tile), both >= 16
    (tl.dot's minimum K), whenever two tiles cover fewer lanes than one next_pow2(head_dim) tile:
    72 -> (64, 16), 40 -> (32, 16), 88 -> (64, 32), 64 -> (64, 0), 100 -> (128, 0), 8 -> (16, 0)."""
    lo = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - lo
    if rest <= 0:
        return lo, 0
    hi = max(16, triton.next_power_of_2(rest))
    if lo + hi >= triton.next_power_of_2(head_dim):
        return triton.next_power_of_2(head_dim), 0
    return lo, hi


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int | None, scale: float) -> torch.Tensor:
    """Triton `vision_attention_ref`: non-causal flash attention within each segment (image) [cu[i], cu[i+1]).

    q, k, v [H, N, Dh] of one dtype (unit last stride, other strides free: head-major from `qkv_split_rope`, or a
    transposed token-major view), cu_seqlens [B+1] int32/int64 on q's device, max_seqlen >= the longest segment
    (host int; None computes it with one device->host sync) -> out [N, H*Dh] in q's dtype, token-major, ready for
    the output projection. Rows outside every segment are not written (as in the reference).
    Math: softmax(q k^T * scale) v per segment and head, fp32 online softmax in the log2 domain, one rounding.
    Kernel: grid (cdiv(max_seqlen, BLOCK_M), B, H); a program holds BLOCK_M query rows of one head and streams
    the segment's keys in BLOCK_N tiles (full tiles unmasked, the ragged last one masked), never forming the
    N x N scores. The head dim is split by `head_split` (Dh = 72: a 64-wide and a 16-wide dot, 80 lanes instead
    of 128, so 1.6x less tensor-core work than padding; see the module docstring for why this is not the text
    prefill kernel). Tiles mirror kernels/attention.py's ptxas-checked sm_90 choices for heads <= 128: 16-bit
    inputs 128x64, 8 warps, 3 stages (wgmma); fp32 exact "ieee" dots (FMA loops) 16x16, 4 warps; the interpreter
    16x16 so short test segments cross tiles (its bf16 dot is wrong, so bf16 uses the fp32 dots there).
    Work: 4*Dh*H*sum(L_i^2) flops (3072 patches, H = 16, Dh = 72: 43.5 GFLOP); traffic: q and out once, K/V once
    per query block (L2-resident: 0.9 MB per head and image).
    """
    check_device(q)
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"vision_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"must all be [H, N, Dh]")
    if q.dtype not in _ACT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"vision_attention: q, k, v must share one of {_ACT_DTYPES}, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"vision_attention: cu_seqlens must be a 1-D int32/int64 tensor, got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"vision_attention: cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
    heads, tokens, head_dim = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cu_seqlens = cu_seqlens.contiguous()
    out = torch.empty(tokens, heads * head_dim, dtype=q.dtype, device=q.device)
    segments = cu_seqlens.shape[0] - 1
    if tokens == 0 or heads == 0 or head_dim == 0 or segments <= 0:
        return out
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if max_seqlen <= 0:
        return out
    dot_f32 = q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16)
    d_lo, d_hi = head_split(head_dim)
    if not dot_f32 and not interpreting():
        # On the H200 the 16-bit split path left the remainder columns (64..71 of a
        # 72-wide head) unwritten; until that is understood, 16-bit heads use one padded power-of-two tile, as the
        # text prefill kernel does. The split stays exercised by the fp32 and interpreter paths.
        d_lo, d_hi = triton.next_power_of_2(head_dim), 0
    if interpreting() or dot_f32:
        block_m, block_n, warps, stages = 16, 16, 4, 2
    elif d_lo + d_hi <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    _vision_attention_kernel[(triton.cdiv(max_seqlen, block_m), segments, heads)](
        q, k, v, out, cu_seqlens, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), heads * head_dim, head_dim,
        D=head_dim, D_LO=d_lo, D_HI=d_hi if d_hi else d_lo, SPLIT=d_hi > 0, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_F32=dot_f32, num_warps=warps, num_stages=stages)
    return out
