"""The W8A8 GEMM quantizing its own activations (`fp8_gemm.fp8_gemm_act`, the GEMM's A_QUANT mode, SMALL_M "w8a8q" of
the dispatch) against the two launches it replaces (`fp8_quantize_act` + `fp8_gemm`) and the fp64 W8A8 reference.

Bit for bit against the two launches on the same tile and split: the fused mode computes q and s with the same
`@triton.jit` helper as the quantize kernel (`fp8_quant.quantize_groups`: the same IEEE divisions, clamp and e4m3
rounding from the same fp32 values), then the same e4m3 dot of the same operands and the same fp32 promotion, split
partials summed in the same order: nothing in the sum changes order, so `torch.equal` (not a tolerance) is the check,
on the interpreter and on the GPU. Against `fp8_block_linear_a8_ref` (fp64 products of the dequantised factors): the
kernel's fp32 sums in another order, then one rounding to the output dtype: `kernel_checks.tol`.
On Triton's CPU interpreter at odd shapes (M 1, 3, 17, 64; N not a multiple of the tile; a partial last group; bias;
packed shards with row_block; fp16 and bf16; split-K on and off; an all-zero group), and on the GPU (marked gpu) at
Qwen3-8B's shapes and every candidate tile.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernel_checks import DEVICE, gpu, poison_allocations, randn, spy_on, tol
from test_fp8_kernels import check, dispatch_ref, fp8_weight, needs_kernels
from orinfer.kernels import fp8_gemm as gemm_module
from orinfer.kernels import fp8_ops
from orinfer.kernels.fp8_block import fp8_block_linear_a8_ref
from orinfer.kernels.fp8_gemm import CANDIDATES, Fp8GemmConfig, fp8_gemm, fp8_gemm_act, fuses_act_quant
from orinfer.kernels.fp8_quant import fp8_quantize_act


@pytest.fixture
def poison(monkeypatch):
    poison_allocations(monkeypatch)


def two_launches(x, weight, scale, block, dtype, row_block=None, bias=None, cfg=None) -> torch.Tensor:
    """What `fp8_gemm_act` replaces: the standalone quantization, then the GEMM on its output."""
    xq, xs = fp8_quantize_act(x, block[1])
    return fp8_gemm(xq, xs[:x.shape[0]], weight, scale, block, dtype, row_block, bias, cfg=cfg)


def check_rows(got: torch.Tensor, x: torch.Tensor, weight, scale, block, row_block=None, bias=None,
               scale_tol: float = 1.0) -> None:
    """got against `fp8_block_linear_a8_ref` in fp64, each row relative to its largest reference value (x's rows span
    1e-2..1e2: `with_zero_group`)."""
    want = fp8_block_linear_a8_ref(x.double(), weight, scale, block, row_block,
                                   None if bias is None else bias.double())
    norm = want.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(got.double() / norm, want / norm, **tol(got.dtype, scale_tol))


def with_zero_group(rows: int, k: int, dtype: torch.dtype, group: int) -> torch.Tensor:
    """Random x [rows, k] over a wide range of magnitudes (a scale per row), its first row's first group all zeros
    (scale 1, q 0)."""
    x = randn(rows, k, dtype=torch.float64) * torch.logspace(-2, 2, rows, dtype=torch.float64, device=DEVICE)[:, None]
    x[0, :group] = 0
    return x.to(dtype)


@needs_kernels
@pytest.mark.parametrize("rows,n,k,block,dtype,bias,shards,cfg", [
    (1, 130, 256, (128, 128), torch.bfloat16, True, 1, Fp8GemmConfig(16, 64, 128, 4, 1)),
    (3, 130, 200, (128, 128), torch.float16, False, 1, Fp8GemmConfig(16, 32, 128, 4, 1, 2)),
    (17, 96, 256, (32, 64), torch.bfloat16, True, 2, Fp8GemmConfig(16, 32, 64, 4, 1, 0)),
    (17, 130, 320, (128, 128), torch.float16, True, 1, Fp8GemmConfig(32, 64, 128, 4, 1)),
    (64, 200, 384, (128, 128), torch.bfloat16, False, 1, Fp8GemmConfig(64, 64, 128, 4, 1, 3)),
    (64, 96, 160, (32, 32), torch.float16, False, 2, Fp8GemmConfig(64, 32, 128, 4, 1, 0)),
    (5, 130, 320, (128, 128), torch.bfloat16, True, 1, None),
])
def test_fp8_gemm_act(rows, n, k, block, dtype, bias, shards, cfg, poison):
    """Bit for bit the two launches on the same tile (module docstring), and the W8A8 reference to tolerance."""
    weight, scale, row_block, _ = fp8_weight(n, k, block, shards)
    b = randn(n, dtype=dtype, scale=0.1) if bias else None
    x = with_zero_group(rows, k, dtype, block[1])
    assert fuses_act_quant(block, cfg or gemm_module.default_config(rows, a_quant=True))
    got = fp8_gemm_act(x, weight, scale, block, dtype, row_block, b, cfg=cfg)
    want = two_launches(x, weight, scale, block, dtype, row_block, b, cfg=cfg)
    assert got.dtype == dtype and got.shape == (rows, n) and not got.isnan().any()
    assert torch.equal(got, want)
    check_rows(got, x, weight, scale, block, row_block, b)


@needs_kernels
def test_fp8_gemm_act_takes_a_strided_x_and_fp32_out(poison):
    """x a column slice of a wider tensor (row stride > K) and fp32 out: the same bits as the two launches."""
    weight, scale, _, _ = fp8_weight(70, 256, (128, 128))
    wide = randn(9, 300, dtype=torch.bfloat16)
    x = wide[:, 20:276]
    cfg = Fp8GemmConfig(16, 32, 128, 4, 1, 2)
    got = fp8_gemm_act(x, weight, scale, (128, 128), torch.float32, cfg=cfg)
    assert torch.equal(got, two_launches(x.contiguous(), weight, scale, (128, 128), torch.float32, cfg=cfg))


@needs_kernels
def test_fp8_gemm_act_falls_back_when_a_step_is_less_than_a_group(monkeypatch, poison):
    """A tile whose K step is shorter than the group (64 of 128) cannot see a group's amax in one step: the
    standalone quantization runs, then the GEMM (the same result, two launches)."""
    weight, scale, _, _ = fp8_weight(130, 256, (128, 128))
    x = with_zero_group(3, 256, torch.bfloat16, 128)
    cfg = Fp8GemmConfig(16, 32, 64, 4, 1, 2)
    assert not fuses_act_quant((128, 128), cfg)
    quantized = spy_on(monkeypatch, gemm_module, "fp8_quantize_act")
    got = fp8_gemm_act(x, weight, scale, (128, 128), torch.bfloat16, cfg=cfg)
    assert quantized == [128]
    assert torch.equal(got, two_launches(x, weight, scale, (128, 128), torch.bfloat16, cfg=cfg))


def test_fp8_gemm_act_rules_and_errors():
    """One K step must be one whole power-of-two group of 32 or more; x bf16 or fp16."""
    tile = Fp8GemmConfig(64, 64, 128, 4, 4, 0)
    assert [bk for bk in (16, 32, 48, 64, 96, 128, 256) if fuses_act_quant((128, bk), tile)] == [32, 64, 128]
    weight, scale, _, _ = fp8_weight(40, 96, (16, 48))
    with pytest.raises(ValueError, match="power-of-two bk"):
        fp8_gemm_act(randn(2, 96, dtype=torch.bfloat16), weight, scale, (16, 48), torch.bfloat16)
    weight, scale, _, _ = fp8_weight(40, 128, (128, 128))
    with pytest.raises(ValueError, match="bf16/fp16"):
        fp8_gemm_act(randn(2, 128, dtype=torch.float32), weight, scale, (128, 128), torch.float32)
    with pytest.raises(ValueError, match="FP8 weight"):
        fp8_gemm_act(randn(2, 64, dtype=torch.bfloat16), weight, scale, (128, 128), torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("rows,dtype", [(2, torch.bfloat16), (17, torch.float16), (64, torch.bfloat16)])
def test_dispatch_small_m_w8a8q(rows, dtype, monkeypatch, poison):
    """SMALL_M = "w8a8q": decode batches of 2..64 rows run the fused GEMM (ungated, and gated as the linear then
    `silu_and_mul`), with its bits, against the W8A8 reference of the path."""
    monkeypatch.setattr(fp8_ops, "SMALL_M", "w8a8q")
    k, n, block = 256, 192, (128, 128)
    weight, scale, _, deq = fp8_weight(n, k, block)
    x = randn(1, rows, k, dtype=dtype)
    assert fp8_ops.linear_path(x, weight, scale, block) == "w8a8q"
    assert fp8_ops.linear_path(x, weight, scale, block, gated=True) == "w8a8q+silu"
    y = fp8_ops.fp8_block_linear(x, weight, scale, block)
    assert torch.equal(y, fp8_gemm_act(x[0], weight, scale, block, dtype)[None])
    check(y, dispatch_ref(x, weight, scale, deq, block), dtype)
    check(fp8_ops.fp8_gate_up_silu(x, weight, scale, block), dispatch_ref(x, weight, scale, deq, block, True), dtype)


# --- GPU: Qwen3-8B shapes, every candidate tile ---------------------------------------------------------------------

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@functools.cache
def qwen_weight(shape: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale) of a Qwen3-8B projection, quantized once for the module's cases."""
    return fp8_weight(*QWEN3_8B[shape], (128, 128))[:2]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [2, 8, 17, 64])
@pytest.mark.parametrize("shape", sorted(QWEN3_8B))
def test_gpu_fp8_gemm_act_qwen3_8b_shapes(shape, rows, dtype):
    """The default small-M tile (split-K by `splitk.plan`) on Qwen3-8B's projections: the two launches' bits, the
    fp64 W8A8 reference to tolerance."""
    weight, scale = qwen_weight(shape)
    x = with_zero_group(rows, weight.shape[1], dtype, 128)
    got = fp8_gemm_act(x, weight, scale, (128, 128), dtype)
    assert torch.equal(got, two_launches(x, weight, scale, (128, 128), dtype))
    check_rows(got, x, weight, scale, (128, 128), scale_tol=2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_every_fp8_gemm_act_config(dtype):
    """Each candidate tile a sweep may promote (`orinfer.bench.fp8_kernels --sweep`'s fused rows) at 64 rows gives
    the two launches' bits on the same tile."""
    weight, scale, _, _ = fp8_weight(1536, 2048, (128, 128))
    x = with_zero_group(64, 2048, dtype, 128)
    for cfg in CANDIDATES:
        got = fp8_gemm_act(x, weight, scale, (128, 128), dtype, cfg=cfg)
        assert torch.equal(got, two_launches(x, weight, scale, (128, 128), dtype, cfg=cfg)), cfg
        check_rows(got, x, weight, scale, (128, 128), scale_tol=2)
