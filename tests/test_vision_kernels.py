"""The Qwen3-VL vision tower's Triton kernels (orinfer/kernels/vision.py) against their pure-torch references.

Runs on a GPU, or on the CPU under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 without CUDA), at odd
shapes: rows not a multiple of the row block, widths like 40/72/88/1100 that no power-of-two tile covers exactly,
several segments of different lengths (1 and 0 included). References run on fp64 copies of the inputs (they
compute in fp32 inside, which is the contract); tolerances are per dtype, `scale=2` where the contract itself has
two roundings to the activation dtype (bias add, then GELU or residual add). "Rounds like the reference" tests
compare against the same-dtype reference within a couple of ulps (fp32, fp16; the interpreter rounds bf16 by
truncation). Outputs are poisoned: every floating torch.empty / empty_like during a test returns NaNs, so an
element a kernel forgets to write fails the comparison. GPU-only tests at Qwen3-VL-8B shapes are marked `gpu`.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from kernel_checks import (DEVICE, DTYPES, INTERPRET, gpu, poison_allocations, randn, tol,
                           skip_module_without_kernels)
from orinfer.kernels import vision
from orinfer.layers.ops import TORCH_OPS, linear_bias_gelu_ref

skip_module_without_kernels()


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert actual.dtype == dtype, (actual.dtype, dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.double(), expected.double(), **tol(dtype, scale))


def ulp_close(actual: torch.Tensor, expected: torch.Tensor, ulps: float = 2.0) -> None:
    """Same-dtype comparison within a few ulps (the kernels round where the references round)."""
    eps = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(actual, expected, atol=ulps * eps, rtol=ulps * eps)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Fresh seed per test, and NaN-filled (floating) allocations while the test runs."""
    poison_allocations(monkeypatch)


def doubles(*tensors):
    return tuple(t.double() for t in tensors)


# --- LayerNorm ----------------------------------------------------------------------------------------------------

# (rows, D): rows not a multiple of ROWS (16 for D <= 128), D from one tile up to 4 x 88 (the post-shuffle width).
NORM_SHAPES = [(1, 40), (37, 72), (5, 1100), (19, 4 * 88)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", NORM_SHAPES)
def test_layer_norm(dtype, rows, dim):
    x = randn(rows, dim, dtype=dtype, scale=3).add_(0.5)  # a non-zero mean, so centring matters
    w, b = randn(dim, dtype=dtype, scale=0.2) + 1, randn(dim, dtype=dtype, scale=0.1)
    x0 = x.clone()
    got = vision.layer_norm(x, w, b, 1e-6)
    close(got, vision.layer_norm_ref(*doubles(x, w, b), 1e-6), dtype)
    assert torch.equal(x, x0)  # out of place


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_rounds_like_the_reference(dtype):
    x, w, b = randn(9, 88, dtype=dtype, scale=2), randn(88, dtype=dtype, scale=0.2) + 1, randn(88, dtype=dtype)
    ulp_close(vision.layer_norm(x, w, b, 1e-6), vision.layer_norm_ref(x, w, b, 1e-6), ulps=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_views(dtype):
    """Strided rows (a column slice of a wider buffer) are read in place; 3-D inputs keep their shape; the
    mergers' post-shuffle norm is the same op on the free [N/4, 4D] view of [N, D]."""
    wide = randn(7, 100, dtype=dtype)
    x = wide[:, 10:82]
    w, b = randn(72, dtype=dtype, scale=0.2) + 1, randn(72, dtype=dtype, scale=0.1)
    close(vision.layer_norm(x, w, b, 1e-5), vision.layer_norm_ref(*doubles(x, w, b), 1e-5), dtype)
    x3 = randn(2, 5, 72, dtype=dtype)
    close(vision.layer_norm(x3, w, b, 1e-5), vision.layer_norm_ref(*doubles(x3, w, b), 1e-5), dtype)
    patches = randn(4 * 3, 40, dtype=dtype)  # 3 merge windows of 2x2 patches, consecutive rows
    merged = patches.view(3, 4 * 40)
    w4, b4 = randn(160, dtype=dtype, scale=0.2) + 1, randn(160, dtype=dtype, scale=0.1)
    close(vision.layer_norm(merged, w4, b4, 1e-6), vision.layer_norm_ref(*doubles(merged, w4, b4), 1e-6), dtype)


def test_layer_norm_mixed_mode():
    """fp32 activations with bf16 weight and bias stay fp32."""
    x = randn(6, 72)
    w, b = randn(72, dtype=torch.bfloat16, scale=0.2) + 1, randn(72, dtype=torch.bfloat16)
    close(vision.layer_norm(x, w, b, 1e-6), vision.layer_norm_ref(x, w, b, 1e-6), torch.float32)


# --- bias + GELU, bias + residual ---------------------------------------------------------------------------------

# (rows, D): D = 1100 takes 9 column blocks of 128 with a ragged last one; 37 rows cross the row block.
EPILOGUE_SHAPES = [(1, 40), (37, 88), (5, 1100)]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # intended: exp(-2u) -> inf gives gelu -> -0
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", EPILOGUE_SHAPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu(dtype, rows, dim, approximate):
    x, b = randn(rows, dim, dtype=dtype, scale=2), randn(dim, dtype=dtype)
    x[0, :4] = torch.tensor([-30.0, -9.0, 9.0, 30.0], dtype=dtype)  # both tails, where tanh/exp saturate
    b[:4] = 0
    x0 = x.clone()
    got = vision.bias_gelu(x, b, approximate)
    close(got, vision.bias_gelu_ref(*doubles(x, b), approximate), dtype, scale=2)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_rounds_like_the_reference(dtype, approximate):
    x, b = randn(9, 88, dtype=dtype, scale=2), randn(88, dtype=dtype)
    got, ref = vision.bias_gelu(x, b, approximate), vision.bias_gelu_ref(x, b, approximate)
    if approximate == "tanh":
        ulp_close(got, ref, ulps=4)
    else:
        # Both sides evaluate 0.5*h*(1 + erf(h/sqrt 2)): for h << 0 the 1 + erf cancels, so a one-ulp difference
        # between two fp32 erf implementations becomes ~ulp * 0.5|h| absolute. Bound it that way, not relatively.
        h = (x + b).double()
        eps = torch.finfo(dtype).eps
        bound = 4 * eps * (ref.double().abs() + 0.5 * h.abs())
        assert ((got.double() - ref.double()).abs() <= bound).all()


ROUNDING_DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="the interpreter rounds fp32 -> bf16 by truncation"))]


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| in units of expected's ulp (floored at the subnormal spacing)."""
    info = torch.finfo(expected.dtype)
    ulp = expected.double().abs().clamp_min(info.tiny) * info.eps
    return (actual.double() - expected.double()).abs() / ulp


@pytest.mark.parametrize("dtype", ROUNDING_DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_rounding_points(dtype, approximate):
    """An fp32 bias goes to the activation dtype, and x + bias is rounded to it, before the GELU. Checked where
    that shows: h in [-3.5, -2.5] (GELU there is small and steep in ulps: one ulp of h moves the output ~10 ulps)
    with a tiny x, so skipping either rounding differs from `expected` by several ulps; the kernel must be
    within 2 (the result's own rounding plus fp32 erf/exp error)."""
    x = randn(4, 200, dtype=dtype, scale=2 ** -10)
    b = torch.rand(200, dtype=torch.float32, device=DEVICE) - 3.5
    h = (x + b.to(dtype)).double()  # torch rounds the 16-bit add to nearest
    expected = torch.nn.functional.gelu(h, approximate=approximate).to(dtype)
    assert ulps_apart(vision.bias_gelu(x, b, approximate), expected).max() <= 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", EPILOGUE_SHAPES)
def test_bias_residual(dtype, rows, dim):
    x, b, r = randn(rows, dim, dtype=dtype), randn(dim, dtype=dtype), randn(rows, dim, dtype=dtype)
    x0, r0 = x.clone(), r.clone()
    got = vision.bias_residual(x, b, r)
    close(got, vision.bias_residual_ref(*doubles(x, b, r)), dtype, scale=2)
    assert torch.equal(x, x0) and torch.equal(r, r0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bias_residual_rounds_like_the_reference(dtype):
    """Two adds, each computed exactly in fp32 and rounded: bit-identical to the same-dtype reference."""
    x, b, r = randn(9, 88, dtype=dtype), randn(88, dtype=dtype), randn(9, 88, dtype=dtype, scale=3)
    assert torch.equal(vision.bias_residual(x, b, r), vision.bias_residual_ref(x, b, r))


@pytest.mark.parametrize("dtype", ROUNDING_DTYPES)
def test_bias_residual_fp32_bias_is_rounded_first(dtype):
    """x tiny next to a bias ~1: round(x + round(b)) and round(x + b) differ in about a quarter of the elements."""
    x, r = randn(4, 200, dtype=dtype, scale=2 ** -12), torch.zeros(4, 200, dtype=dtype, device=DEVICE)
    b = 1 + 0.1 * torch.randn(200, dtype=torch.float32, device=DEVICE)
    assert torch.equal(vision.bias_residual(x, b, r), vision.bias_residual_ref(x, b, r))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_residual_strided_rows(dtype):
    wide_x, wide_r = randn(6, 200, dtype=dtype), randn(6, 150, dtype=dtype)
    x, r, b = wide_x[:, 3:75], wide_r[:, 50:122], randn(72, dtype=dtype)
    close(vision.bias_residual(x, b, r), vision.bias_residual_ref(*doubles(x, b, r)), dtype, scale=2)


# --- QKV split + RoPE + transpose ---------------------------------------------------------------------------------

def rope_tables(tokens: int, half: int, dtype=torch.float32):
    angles = torch.rand(tokens, half, dtype=torch.float64, device=DEVICE) * 50  # any angles; 2-D RoPE mixes two
    return angles.cos().to(dtype), angles.sin().to(dtype)


# (N, H, Dh): one token; 1332 (token, j) pairs -> 2 blocks per head; Dh = 40 and 88 with halves 20 and 44.
ROPE_SHAPES = [(1, 2, 40), (37, 3, 72), (29, 2, 88)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", ROPE_SHAPES)
def test_qkv_split_rope(dtype, tokens, heads, head_dim):
    qkv = randn(tokens, 3 * heads * head_dim, dtype=dtype)
    cos, sin = rope_tables(tokens, head_dim // 2)
    qkv0 = qkv.clone()
    got = vision.qkv_split_rope(qkv, cos, sin, heads)
    ref = vision.qkv_split_rope_ref(qkv.double(), cos.double(), sin.double(), heads)
    for g, e in zip(got[:2], ref[:2]):
        assert g.shape == (heads, tokens, head_dim) and g.transpose(0, 1).is_contiguous()  # token-major storage
        close(g, e, dtype)
    assert got[2].transpose(0, 1).is_contiguous()
    assert torch.equal(got[2], qkv.view(tokens, 3, heads, head_dim)[:, 2].transpose(0, 1))
    assert all(t.transpose(0, 1).is_contiguous() for t in ref)
    assert torch.equal(qkv, qkv0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qkv_split_rope_rounds_like_the_reference(dtype):
    qkv = randn(11, 3 * 2 * 72, dtype=dtype)
    cos, sin = rope_tables(11, 36)
    for g, e in zip(vision.qkv_split_rope(qkv, cos, sin, 2), vision.qkv_split_rope_ref(qkv, cos, sin, 2)):
        ulp_close(g, e)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_split_rope_strided_inputs_and_16bit_tables(dtype):
    """qkv as a column slice of a wider buffer, cos/sin as bf16 column slices: read in place, used as given."""
    tokens, heads, head_dim = 13, 2, 40
    qkv = randn(tokens, 3 * heads * head_dim + 24, dtype=dtype)[:, 8: 8 + 3 * heads * head_dim]
    table = randn(tokens, 2 * head_dim, dtype=torch.bfloat16)
    cos, sin = table[:, :head_dim // 2], table[:, head_dim: head_dim + head_dim // 2]
    got = vision.qkv_split_rope(qkv, cos, sin, heads)
    ref = vision.qkv_split_rope_ref(qkv.double(), cos.double(), sin.double(), heads)
    for g, e in zip(got, ref):
        close(g, e, dtype)


# --- vision attention ---------------------------------------------------------------------------------------------

ATTN_CASES = [  # (segment lengths, heads, head_dim); the interpreter's tiles are 16x16
    ([1], 1, 16),
    ([17, 1, 40], 2, 72),          # Qwen3-VL's head dim: a 64 + 16 split, the tail masked to 8
    ([33, 5, 0, 1, 16], 2, 40),    # an empty segment; 32 + 16 split
    ([20, 31], 1, 88),             # 64 + 32 split
    ([16, 3], 2, 64),              # a power of two: one tile, no split
]


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ATTN_CASES, ids=[f"len{c[0]}-h{c[1]}-d{c[2]}" for c in ATTN_CASES])
@pytest.mark.parametrize("give_max", [False, True])
def test_vision_attention(dtype, case, give_max):
    lengths, heads, head_dim = case
    tokens = sum(lengths)
    q, k, v = (randn(heads, tokens, head_dim, dtype=dtype) for _ in range(3))
    q.mul_(2)  # sharper softmax than unit scores, so a wrong max or mask shows
    scale = vision.default_scale(head_dim)
    starts = cu(lengths)
    got = vision.vision_attention(q, k, v, starts, max(lengths) if give_max else None, scale)
    ref = vision.vision_attention_ref(*doubles(q, k, v), starts, None, scale)
    close(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_attention_token_major_views(dtype):
    """q/k/v as [H, N, Dh] views of a token-major packed [N, 3, H, Dh] buffer (HF's layout before a transpose)."""
    lengths, heads, head_dim = [9, 18], 3, 72
    tokens = sum(lengths)
    packed = randn(tokens, 3, heads, head_dim, dtype=dtype)
    q, k, v = (packed[:, i].transpose(0, 1) for i in range(3))
    starts = cu(lengths)
    got = vision.vision_attention(q, k, v, starts, 18, 0.2)
    close(got, vision.vision_attention_ref(*doubles(q, k, v), starts, None, 0.2), dtype)


def test_head_split():
    assert vision.head_split(72) == (64, 16)
    assert vision.head_split(40) == (32, 16)
    assert vision.head_split(88) == (64, 32)
    assert vision.head_split(80) == (64, 16)
    assert vision.head_split(64) == (64, 0)
    assert vision.head_split(100) == (128, 0)
    assert vision.head_split(8) == (16, 0)


# --- contract checks and wiring -----------------------------------------------------------------------------------

def test_wrappers_reject_mismatched_inputs():
    x = randn(4, 72)
    with pytest.raises(ValueError):
        vision.layer_norm(x, randn(71), randn(72), 1e-6)
    with pytest.raises(ValueError):
        vision.bias_gelu(x, randn(72), approximate="sigmoid")
    with pytest.raises(ValueError):
        vision.bias_residual(x, randn(72), randn(4, 72, dtype=torch.float16))
    with pytest.raises(ValueError):
        vision.qkv_split_rope(randn(4, 3 * 2 * 72), randn(4, 72), randn(4, 72), 2)  # cos must be [N, Dh/2]
    with pytest.raises(ValueError):
        vision.qkv_split_rope(randn(4, 100), randn(4, 10), randn(4, 10), 2)  # 100 is not 3*2*Dh
    q = randn(2, 4, 16)
    with pytest.raises(ValueError):
        vision.vision_attention(q, q, randn(2, 4, 16, dtype=torch.float16), cu([4]), 4, 0.25)
    with pytest.raises(ValueError):
        vision.vision_attention(q, q, q, cu([4]).float(), 4, 0.25)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_linear_bias_gelu_matches_reference(approximate):
    """The triton table's fc1 op (a cuBLASLt GELU epilogue on CUDA for the tanh GELU, else GEMM + bias_gelu) against
    the fp64 reference: GEMM, bias, GELU of the chosen form. bf16 on CUDA, fp32 here."""
    from orinfer.layers.triton_ops import linear_bias_gelu

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, w, b = randn(37, 64, dtype=dtype), randn(48, 64, dtype=dtype, scale=0.25), randn(48, dtype=dtype)
    got = linear_bias_gelu(x, w, b, approximate)
    want = F.gelu(F.linear(*doubles(x, w, b)), approximate=approximate)
    assert got.shape == (37, 48) and got.dtype == dtype
    close(got, want, dtype, scale=2)
    assert TORCH_OPS.linear_bias_gelu is linear_bias_gelu_ref


def test_triton_backend_uses_the_vision_kernels():
    from orinfer.layers.triton_ops import triton_ops

    ops = triton_ops()
    assert ops.layer_norm is vision.layer_norm and ops.bias_gelu is vision.bias_gelu
    assert ops.bias_residual is vision.bias_residual and ops.qkv_split_rope is vision.qkv_split_rope
    from orinfer.layers.triton_ops import segment_flash_attention
    assert ops.vision_attention is segment_flash_attention  # SDPA flash per image in 16-bit, the Triton kernel in fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bounds", [[0, 5, 6, 19], [0, 19]])
@pytest.mark.parametrize("token_major", [False, True])
def test_segment_flash_attention_matches_reference(dtype, bounds, token_major):
    """The triton backend's vision attention (SDPA per segment for 16-bit, the Triton kernel for fp32) keeps
    every token within its image, like the reference: several images or one (no output copy), q/k/v head-major or
    stored token-major as `qkv_split_rope` leaves them."""
    from orinfer.layers.triton_ops import segment_flash_attention

    heads, head_dim = 2, 40
    shape = (bounds[-1], heads, head_dim) if token_major else (heads, bounds[-1], head_dim)
    q, k, v = (torch.randn(*shape, device=DEVICE).to(dtype) for _ in range(3))
    if token_major:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    longest = max(end - begin for begin, end in zip(bounds[:-1], bounds[1:]))
    got = segment_flash_attention(q, k, v, cu, longest, head_dim ** -0.5)
    ref = vision.vision_attention_ref(q.double(), k.double(), v.double(), cu, longest, head_dim ** -0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)


# --- Qwen3-VL-8B shapes: GPU only ---------------------------------------------------------------------------------
# One 1024x768 image: N = 64*48 = 3072 patches; D = 1152, MLP 4304, 16 heads of 72; merger width 4*1152 = 4608.

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_vision_row_ops_qwen3vl_shapes(dtype):
    for rows, dim in ((3072, 1152), (768, 4608)):
        x = randn(rows, dim, dtype=dtype, scale=3).add_(0.5)
        w, b = randn(dim, dtype=dtype, scale=0.2) + 1, randn(dim, dtype=dtype, scale=0.1)
        close(vision.layer_norm(x, w, b, 1e-6), vision.layer_norm_ref(*doubles(x, w, b), 1e-6), dtype)
    for rows, dim, approximate in ((3072, 4304, "tanh"), (768, 4608, "none")):
        x, b = randn(rows, dim, dtype=dtype, scale=2), randn(dim, dtype=dtype)
        close(vision.bias_gelu(x, b, approximate), vision.bias_gelu_ref(*doubles(x, b), approximate), dtype, scale=2)
    x, b, r = randn(3072, 1152, dtype=dtype), randn(1152, dtype=dtype), randn(3072, 1152, dtype=dtype)
    close(vision.bias_residual(x, b, r), vision.bias_residual_ref(*doubles(x, b, r)), dtype, scale=2)
    # On the GPU bf16 rounds to nearest as torch does, so the two-add epilogue is bit-exact in every dtype.
    assert torch.equal(vision.bias_residual(x, b, r), vision.bias_residual_ref(x, b, r))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_qkv_split_rope_qwen3vl_shapes(dtype):
    tokens, heads, head_dim = 3072, 16, 72
    qkv = randn(tokens, 3 * heads * head_dim, dtype=dtype)
    cos, sin = rope_tables(tokens, head_dim // 2)
    got = vision.qkv_split_rope(qkv, cos, sin, heads)
    ref = vision.qkv_split_rope_ref(qkv.double(), cos.double(), sin.double(), heads)
    for g, e in zip(got[:2], ref[:2]):
        close(g, e, dtype)
    assert torch.equal(got[2], ref[2].to(dtype))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [72, 64, 80])
@pytest.mark.parametrize("lengths", [[3072], [1024, 1, 777, 2051, 0, 64]], ids=["one-image", "mixed"])
def test_gpu_vision_attention_qwen3vl_shapes(dtype, head_dim, lengths):
    heads, tokens = 16, sum(lengths)
    q, k, v = (randn(heads, tokens, head_dim, dtype=dtype) for _ in range(3))
    q.mul_(2)
    starts = cu(lengths)
    scale = vision.default_scale(head_dim)
    ref = vision.vision_attention_ref(*doubles(q, k, v), starts, None, scale)
    close(vision.vision_attention(q, k, v, starts, max(lengths), scale), ref, dtype)
    close(vision.vision_attention(q, k, v, starts, None, scale), ref, dtype)
