"""orinfer's W4 INT4 layout and its Triton kernels (GEMV, tensor-core MMA, dequantisation) against torch references.

Kernels run on CUDA, or in Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest.py without a GPU) at small
shapes. References are computed in fp64 from the AWQ checkpoint tensors, so the repacking is checked at the same time.
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, poison_allocations, randn
from orinfer.kernels import awq as A
from orinfer.kernels import w4 as W
from orinfer.kernels import w4_int_step as WI
from orinfer.kernels.w4_gemv import GEMV_CONFIGS, UNROLL_STEPS, W4GemvConfig, w4_gemv, w4_gemv_int
from orinfer.kernels.w4_mma import MMA_CONFIGS, W4MmaConfig, w4_dequantize, w4_mma
from orinfer.kernels.w4_ops import MMA_MAX_ROWS, w4_gate_up_silu, w4_linear
from test_awq import INTERPRET, needs_kernels, random_awq, tol

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def poison(monkeypatch):
    poison_allocations(monkeypatch)


kernel_test = pytest.mark.usefixtures("poison")


def random_w4(k: int, n: int, g: int, device=DEVICE) -> tuple[W.W4Weight, tuple]:
    awq = random_awq(k, n, g, device=device)
    return W.repack_awq(*awq, g), awq


# --- layout (torch only) ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k,n,g", [(256, 24, 128), (96, 16, 32), (64, 8, 16), (512, 40, 256), (128, 16, -1)])
def test_repack_is_exact_and_reversible(k, n, g):
    w, (qweight, qzeros, scales) = random_w4(k, n, g, device="cpu")
    assert w.packed.shape == (n, k // 8) and w.zeros.dtype == torch.uint8 and w.scales.shape == (n, k // w.group_size)
    torch.testing.assert_close(W.w4_dequantize_ref(w, torch.float64),
                               A.awq_dequantize_ref(qweight, qzeros, scales, g, torch.float64).t(), atol=0, rtol=0)
    for got, want in zip(W.w4_to_awq(w), (qweight, qzeros, scales)):
        assert torch.equal(got, want)


def test_chunk_order_matches_the_definition():
    """Nibble p of int32 r of a chunk holds input k = chunk * 8R + p * R + r (R = 16 at group 128)."""
    q = torch.randint(0, 16, (3, 256), dtype=torch.int32)
    packed = W._pack_rows(q, 16)
    for n, c, p in [(0, 0, 0), (1, 5, 3), (2, 17, 7), (2, 31, 6)]:
        k = (c // 16) * 128 + p * 16 + c % 16
        assert (int(packed[n, c]) >> (4 * p)) & 15 == int(q[n, k])
    assert torch.equal(W.w4_unpack(packed, 128), q)


@pytest.mark.parametrize("g", [48, 96, 192])
def test_unsupported_group_sizes_are_rejected(g):
    with pytest.raises(ValueError, match="not supported"):
        W.check_group_size(192 * 4, g)


# --- kernels ---------------------------------------------------------------------------------------------------------

def _ref(x, awq, g, bias=None, gated=False):
    if gated:
        return A.awq_fused_gate_up_silu_ref(x.double(), *awq, g)
    return A.awq_linear_ref(x.double(), *awq, g, None if bias is None else bias.double())


@needs_kernels
@kernel_test
@pytest.mark.pairwise(each_value=True)  # ~5-15 s a case interpreted: the pairs run in the slow tier
@pytest.mark.parametrize("kernel,dtype", [(w4_gemv, dt) for dt in DTYPES]
                         + [(w4_gemv_int, dt) for dt in (torch.float16, torch.bfloat16)])   # int: 16-bit x only
@pytest.mark.parametrize("cfg", [W4GemvConfig(2, 64, 2), W4GemvConfig(4, 16, 1), W4GemvConfig(1, 512, 4),
                                 W4GemvConfig(4, 16, 1, preload=True), None])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("k", [384, 512])
def test_w4_gemv(kernel, dtype, cfg, gated, k):
    """One row, both steps (fp32 planes, integer); N = 80 (not a multiple of the row tile). K = 384: 3 groups of 128
    (not a power of two), 3 steps per row; K = 512: one step (the whole row in one tile) for the configs with 64+
    int32 per step."""
    w, awq = random_w4(k, 80, 128)
    x, bias = randn(1, k, dtype=dtype), None if gated else randn(80, dtype=dtype, scale=0.5)
    got = kernel(x, w, bias, gated=gated, cfg=cfg)
    assert got.shape == (1, 40 if gated else 80) and got.dtype == dtype
    torch.testing.assert_close(got.double(), _ref(x, awq, 128, bias, gated), **tol(dtype, 3))


@needs_kernels
@kernel_test
@pytest.mark.parametrize("gated", [False, True])
def test_w4_gemv_many_steps(gated):
    """More steps per row than `UNROLL_STEPS` (8 steps of 32 int32): the runtime loop instead of straight-line code."""
    cfg = W4GemvConfig(2, 32, 2)
    assert 2048 // 8 // cfg.block_kp > UNROLL_STEPS
    w, awq = random_w4(2048, 48, 128)
    x = randn(1, 2048, dtype=torch.bfloat16)
    got = w4_gemv(x, w, gated=gated, cfg=cfg)
    torch.testing.assert_close(got.double(), _ref(x, awq, 128, None, gated), **tol(torch.bfloat16, 3))


@needs_kernels
@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [2.0 ** 40, 2.0 ** -58])
def test_w4_gemv_activation_range(dtype, scale):
    """The GEMV scales x by up to 2^85 and its products by 2^-64 (`w4_gemv` docstring): activations near both ends
    of the documented range [2^-62, 2^43] still give the reference's result to the dtype's tolerance."""
    w, awq = random_w4(512, 48, 128)
    x = (randn(1, 512, dtype=torch.float32) * scale).to(dtype)
    got = w4_gemv(x, w, None)
    want = _ref(x, awq, 128, None, False)
    torch.testing.assert_close(got.double() / scale, want / scale, **tol(dtype, 3))


def _x_rounded16(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """x as `w4_gemv_int` multiplies it (its docstring): per chunk of `chunk` inputs, rounded (half to even) to
    multiples of 2^(e - 14), e = floor(log2 of the chunk's largest |x|), in fp64."""
    xc = x.double().reshape(-1, chunk)
    _, ex = torch.frexp(xc.abs().amax(dim=1, keepdim=True))        # amax = m 2^ex, m in [0.5, 1): e = ex - 1
    f = torch.ldexp(torch.ones_like(xc[:, :1]), 15 - ex.clamp(min=-111))
    return (torch.round(xc * f) / f).reshape(x.shape)


@needs_kernels
@kernel_test
@pytest.mark.parametrize("g,k", [(16, 64), (32, 96), (64, 256), (256, 512)])
@pytest.mark.parametrize("gated", [False, True])
def test_w4_gemv_int_group_sizes(g, k, gated):
    """Chunks of 8R inputs for groups below 128 (R = g / 8), and two chunks per group at 256."""
    w, awq = random_w4(k, 32, g)
    x = randn(1, k, dtype=torch.bfloat16)
    got = w4_gemv_int(x, w, gated=gated, cfg=W4GemvConfig(4, 64, 2))
    torch.testing.assert_close(got.double(), _ref(x, awq, g, None, gated), **tol(torch.bfloat16, 3))


@pytest.mark.slow  # ~30 s in Triton's CPU interpreter; CI's slow tier and the GPU run it
@needs_kernels
@kernel_test
def test_w4_gemv_int_many_steps():
    """More steps than `UNROLL_STEPS`: the runtime loop."""
    cfg = W4GemvConfig(2, 32, 2)
    assert 2048 // 8 // cfg.block_kp > UNROLL_STEPS
    w, awq = random_w4(2048, 48, 128)
    x = randn(1, 2048, dtype=torch.bfloat16)
    for gated in (False, True):
        got = w4_gemv_int(x, w, gated=gated, cfg=cfg)
        torch.testing.assert_close(got.double(), _ref(x, awq, 128, None, gated), **tol(torch.bfloat16, 3))


@needs_kernels
@kernel_test
@pytest.mark.parametrize("scale", [1.0, 2.0 ** 100, 2.0 ** -100])
def test_w4_gemv_int_rounds_x_to_16_bits_per_chunk(scale):
    """With outliers 1000x the rest (a chunk's small inputs then keep few bits) and at both ends of bf16's range, the
    result is the exact product with x rounded as the docstring says (`_x_rounded16`), to fp32 summation error and
    the output's rounding; fp32 x is refused (it takes `w4_gemv`)."""
    w, awq = random_w4(512, 48, 128)
    x = randn(1, 512, dtype=torch.float32)
    x[0, ::97] *= 1000
    x = (x * scale).to(torch.bfloat16)
    got = w4_gemv_int(x, w).double()
    want = A.awq_linear_ref(_x_rounded16(x, 128), *awq, 128)
    # the output's rounding: half an ulp of bf16 (a whole one in the interpreter, which truncates); the fp32 sums'
    # error: far below 2^-16 of the largest output
    rtol = 2 ** -7 if INTERPRET else 2 ** -8
    torch.testing.assert_close(got / scale, want / scale, atol=2 ** -16 * (want / scale).abs().max().item(), rtol=rtol)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        w4_gemv_int(x.float(), w)
    with pytest.raises(ValueError, match="one row"):
        w4_gemv_int(x.expand(2, 512), w)


@needs_kernels
@kernel_test
def test_w4_gemv_int_non_finite_x_gives_nan():
    w, _ = random_w4(256, 16, 128)
    x = randn(1, 256, dtype=torch.bfloat16)
    x[0, 3] = float("inf")
    assert torch.isnan(w4_gemv_int(x, w)).all()


def test_w4_gemv_int_takes_16_bit_gated_and_long_rows():
    w_short, w_long = random_w4(4096, 8, 128, "cpu")[0], random_w4(4096 + 128, 8, 128, "cpu")[0]
    bf16, fp32 = torch.zeros(4096, dtype=torch.bfloat16), torch.zeros(4096)
    assert WI.takes(bf16, w_short, gated=True) and not WI.takes(bf16, w_short, gated=False)
    assert WI.takes(torch.zeros(4224, dtype=torch.float16), w_long, gated=False)
    assert not WI.takes(fp32, w_short, gated=True)


@needs_kernels
@kernel_test
@pytest.mark.pairwise(each_value=True)  # the pairs run in the slow tier
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 7, 16, 17, 40])
@pytest.mark.parametrize("cfg", [W4MmaConfig(16, 32, 4, 2, 1), W4MmaConfig(16, 16, 1, 1, 1, prefetch=False), None,
                                 W4MmaConfig(16, 32, 4, 2, split_k=3, prefetch=False),
                                 W4MmaConfig(16, 16, 1, 1, split_k=4)])
@pytest.mark.parametrize("gated", [False, True])
def test_w4_mma(dtype, rows, cfg, gated):
    """K = 512 at group 128 is 4 chunks: split_k 3 becomes 2 splits of 2 chunks, split_k 4 one chunk each."""
    w, awq = random_w4(512, 96, 128)
    x, bias = randn(rows, 512, dtype=dtype), None if gated else randn(96, dtype=dtype, scale=0.5)
    got = w4_mma(x, w, bias, gated=gated, cfg=cfg)
    assert got.shape == (rows, 48 if gated else 96) and got.dtype == dtype
    torch.testing.assert_close(got.double(), _ref(x, awq, 128, bias, gated), **tol(dtype, 3))


@needs_kernels
@kernel_test
@pytest.mark.parametrize("g,k", [(16, 64), (32, 96), (128, 384), (-1, 256), (256, 512)])
@pytest.mark.parametrize("rows", [1, 3, MMA_MAX_ROWS + 1])
def test_w4_linear_group_sizes_and_dispatch(g, k, rows):
    """Every supported group size through the public entry point (GEMV, MMA, dequantise + matmul by row count)."""
    w, awq = random_w4(k, 32, g)
    x = randn(rows, k)
    torch.testing.assert_close(w4_linear(x, w).double(), _ref(x, awq, g), **tol(torch.float32, 2))
    torch.testing.assert_close(w4_gate_up_silu(x, w).double(), _ref(x, awq, g, gated=True), **tol(torch.float32, 3))


@needs_kernels
@kernel_test
def test_leading_dims_and_empty_input():
    w, awq = random_w4(128, 32, 64)
    x = randn(2, 3, 128)
    got = w4_linear(x, w)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got.double(), _ref(x.reshape(6, 128), awq, 64).reshape(2, 3, 32), **tol(torch.float32))
    assert w4_mma(randn(0, 128), random_w4(128, 32, 128)[0]).shape == (0, 32)
    with pytest.raises(ValueError, match="multiple of 128"):
        w4_mma(randn(2, 128), w)   # group 64: `w4_linear` takes the dequantise + matmul path instead
    with pytest.raises(ValueError, match="one row"):
        w4_gemv(randn(2, 128), w)


@needs_kernels
@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", [16, 64, 128])
@pytest.mark.parametrize("k", [256, 384])   # 384 with g = 128: three chunks, the program's fourth masked
def test_w4_dequantize(dtype, g, k):
    w, _ = random_w4(k, 40, g)
    got, ref = w4_dequantize(w, dtype), W.w4_dequantize_ref(w, dtype)
    if dtype == torch.bfloat16 and INTERPRET:  # the interpreter rounds fp32 -> bf16 by truncation (<= 1 ulp)
        torch.testing.assert_close(got, ref, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(got, ref)


@needs_kernels
@kernel_test
def test_w4_dequantize_into_a_buffer():
    w, _ = random_w4(256, 24, 128)
    buf = torch.full((24, 256), float("nan"), dtype=torch.float32, device=DEVICE)
    assert w4_dequantize(w, torch.float32, out=buf) is buf
    assert torch.equal(buf, W.w4_dequantize_ref(w, torch.float32))
    with pytest.raises(ValueError, match=r"contiguous \[24, 256\]"):
        w4_dequantize(w, torch.float32, out=buf.t().contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        w4_dequantize(w, torch.bfloat16, out=buf)


@needs_kernels
@kernel_test
@pytest.mark.parametrize("rows", [1, 3, MMA_MAX_ROWS + 1])
def test_fp16_output_is_clamped_not_inf(rows):
    """Outputs beyond fp16's range are clamped to +-65504 (as the reference), never inf."""
    qweight = torch.full((64, 4), 0x77777777, dtype=torch.int32, device=DEVICE)   # q = 7 everywhere
    qzeros = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)                  # z = 0
    scales = torch.full((2, 32), 100.0, dtype=torch.float16, device=DEVICE)
    w = W.repack_awq(qweight, qzeros, scales, 32)
    x = torch.full((rows, 64), 200.0, dtype=torch.float16, device=DEVICE)
    x[1::2] *= -1
    got = w4_linear(x, w)
    assert torch.isfinite(got).all() and (got.abs() == 65504).all()
    assert torch.equal(got, W.w4_linear_ref(x, w))


# --- GPU only: Qwen3-8B shapes, every config ------------------------------------------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 16, 32, 64, 2048])
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (12288, 4096)])
def test_gpu_w4_linear_qwen3_8b_shapes(dtype, rows, k, n):
    w, awq = random_w4(k, n, 128)
    x = randn(rows, k, dtype=dtype)
    if rows > MMA_MAX_ROWS:
        # dequantise + cuBLAS rounds the weight to the activation dtype first, as every W4A16 GEMM does
        ref = x.float() @ W.w4_dequantize_ref(w, dtype).float().t()
    else:
        ref = A.awq_linear_ref(x.float(), *awq, 128)
    torch.testing.assert_close(w4_linear(x, w).float(), ref, **tol(dtype, 4))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_gpu_w4_gate_up_qwen3_8b(dtype, rows):
    w, awq = random_w4(4096, 2 * 12288, 128)
    x = randn(rows, 4096, dtype=dtype)
    torch.testing.assert_close(w4_gate_up_silu(x, w).float(),
                               A.awq_fused_gate_up_silu_ref(x.float(), *awq, 128).float(), **tol(dtype, 4))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_every_config_is_correct(dtype):
    """Each config a sweep may promote to default computes the same thing."""
    w, awq = random_w4(2048, 1536, 128)
    one_row = ((1, w4_gemv, GEMV_CONFIGS), (1, w4_gemv_int, GEMV_CONFIGS))
    for rows, kernel, cfgs in one_row + ((8, w4_mma, MMA_CONFIGS),):
        x = randn(rows, 2048, dtype=dtype)
        exact = A.awq_linear_ref(x.float(), *awq, 128)
        exact_g = A.awq_fused_gate_up_silu_ref(x.float(), *awq, 128).float()
        for cfg in cfgs:
            torch.testing.assert_close(kernel(x, w, cfg=cfg).float(), exact, **tol(dtype, 4),
                                       msg=lambda m: f"{kernel.__name__} {cfg}: {m}")
            torch.testing.assert_close(kernel(x, w, gated=True, cfg=cfg).float(), exact_g, **tol(dtype, 4),
                                       msg=lambda m: f"{kernel.__name__} {cfg} gated: {m}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_gpu_awq_model_triton_matches_torch_backend(tmp_path, cuda_graph):
    """A tiny RTN-quantized Qwen3 on CUDA: the triton backend (W4 GEMV/MMA, fused gate/up, CUDA graphs) gives the torch
    backend's greedy tokens in fp32, for one sequence and a batch of five (GEMV and MMA decode paths)."""
    from hf_models import build_hf_model, save_hf_model
    from quant_parity import assert_triton_matches_torch_on_cuda
    from orinfer.quant import quantize_checkpoint

    orig = save_hf_model(build_hf_model("qwen3-gqa4-untied"), tmp_path / "orig")
    quantize_checkpoint(orig, tmp_path / "awq", method="rtn", group_size=32, progress=False)
    assert_triton_matches_torch_on_cuda(tmp_path / "awq", cuda_graph)
