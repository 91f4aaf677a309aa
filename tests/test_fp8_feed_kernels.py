"""FP8 activation feeding's producers (kernels/fp8_feed.py): bit for bit the unfused pair they replace (`rms_norm`
then `fp8_quantize_act`; `silu_and_mul` then `fp8_quantize_act`), padding rows and the scales' layout included, at odd
shapes with NaN-poisoned outputs; and close to the torch references. On Triton's CPU interpreter, and on the GPU
(marked gpu: Qwen3-8B's shapes at 8, 64 and 512 rows, eager and replayed in a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, captured, gpu, poison_allocations, randn, skip_module_without_kernels
from orinfer.kernels.activation import silu_and_mul
from orinfer.kernels.fp8_feed import (rms_norm_fp8, rms_norm_fp8_ref, silu_and_mul_fp8, silu_and_mul_fp8_ref)
from orinfer.kernels.fp8_quant import Fp8Act, fp8_quantize_act
from orinfer.kernels.norm import rms_norm

skip_module_without_kernels()

EPS = 1e-6


@pytest.fixture
def poison(monkeypatch):
    poison_allocations(monkeypatch)


def norm_weight(h: int, dtype: torch.dtype, zero_centered: bool) -> torch.Tensor:
    """An RMSNorm weight as layers/norm.py keeps it: in the model's dtype, or 1 + w in fp32 (zero-centred)."""
    if zero_centered:
        return 1.0 + randn(h, dtype=torch.float32, scale=0.1)
    return (1.0 + randn(h, dtype=torch.float32, scale=0.1)).to(dtype)


def assert_same_act(got: Fp8Act, want: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype,
                    shape: tuple[int, ...]) -> None:
    """got is the Fp8Act of `fp8_quantize_act`'s (q, s) bit for bit: every padded row, the scales' strides."""
    q, s = want
    assert isinstance(got, Fp8Act) and got.dtype == dtype and got.shape == shape
    assert got.q.shape == q.shape and got.q.dtype == torch.float8_e4m3fn
    assert got.scale.shape == s.shape and got.scale.stride() == s.stride() and got.scale.stride(0) == 1
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.scale, s)
    assert q.shape[0] % 4 == 0 and 0 <= q.shape[0] - got.rows < 4                   # M_pad: M rounded up to 4


def dequantized(act: Fp8Act, group: int) -> torch.Tensor:
    k = act.shape[-1]
    return (act.q[:act.rows].float() * act.scale[:act.rows].repeat_interleave(group, dim=1)[:, :k]).double()


def assert_within_one_code(got: Fp8Act, ref: Fp8Act, group: int) -> None:
    """got and the torch reference's quantized values are at most one e4m3 step apart (2^-3 of a value, or the
    smallest subnormal step of its group's scale): the 16-bit values before quantization may differ by a rounding
    (the reference's rsqrt, the interpreter's truncating bf16 casts), which can move a value across a code boundary."""
    a, b = dequantized(got, group), dequantized(ref, group)
    step = torch.maximum(a.abs(), b.abs()) * 2.0 ** -3
    k = got.shape[-1]
    step += got.scale[:got.rows].double().repeat_interleave(group, dim=1)[:, :k] * 2.0 ** -9
    assert ((a - b).abs() <= step).all(), ((a - b).abs() - step).max()


def check_rms_norm_fp8(rows: int, h: int, dtype: torch.dtype, residual: bool, zero_centered: bool,
                       group: int = 128, lead: tuple[int, ...] = ()) -> None:
    x = randn(*lead, rows, h, dtype=dtype, scale=3.0)
    x[..., 0, :min(h, group)] = 0                           # an all-zero group once the residual is added
    r = -x.clone() if residual else None
    if residual:
        r[..., 1:, :] = randn(*lead, rows - 1, h, dtype=dtype)
    w = norm_weight(h, dtype, zero_centered)
    got = rms_norm_fp8(x, w, EPS, r, group)
    unfused = rms_norm(x, w, EPS, r)
    normed = unfused[0] if residual else unfused
    act = got[0] if residual else got
    assert_same_act(act, fp8_quantize_act(normed.reshape(-1, h), group), dtype, tuple(x.shape))
    if residual:
        assert got[1].shape == x.shape and torch.equal(got[1], unfused[1])
    ref = rms_norm_fp8_ref(x, w, EPS, r, group)
    assert_within_one_code(act, ref[0] if residual else ref, group)


@pytest.mark.pairwise
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h", [4096, 2560, 200])
@pytest.mark.parametrize("rows", [1, 3, 64, 200])
def test_rms_norm_fp8_is_rms_norm_then_quantize_bit_for_bit(rows, h, dtype, residual, zero_centered, poison):
    check_rms_norm_fp8(rows, h, dtype, residual, zero_centered)


@pytest.mark.parametrize("h,group,lead", [(96, 128, ()), (64, 32, (2,)), (256, 16, ())])
def test_rms_norm_fp8_narrow_rows_other_groups_and_leading_dims(h, group, lead, poison):
    """A row narrower than the group (its only group), groups of 32 and 16, x [2, T, H]."""
    check_rms_norm_fp8(5, h, torch.bfloat16, True, False, group, lead)


def test_rms_norm_fp8_without_rows_and_errors():
    x = randn(0, 256, dtype=torch.bfloat16)
    act = rms_norm_fp8(x, torch.ones(256, device=DEVICE), EPS)
    assert act.q.shape == (0, 256) and act.scale.shape == (0, 2) and act.rows == 0
    with pytest.raises(ValueError, match="do not match"):
        rms_norm_fp8(randn(2, 256, dtype=torch.bfloat16), torch.ones(128, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="power of two"):
        rms_norm_fp8(randn(2, 256, dtype=torch.bfloat16), torch.ones(256, device=DEVICE), EPS, group=96)


@pytest.mark.pairwise
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [1536, 384, 200])
@pytest.mark.parametrize("rows", [1, 3, 64, 200])
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantize_bit_for_bit(rows, inter, dtype, poison):
    gate_up = randn(rows, 2 * inter, dtype=dtype, scale=4.0)
    gate_up[0, :128] = 0                                    # silu(0) = 0: an all-zero group
    got = silu_and_mul_fp8(gate_up)
    assert_same_act(got, fp8_quantize_act(silu_and_mul(gate_up), 128), dtype, (rows, inter))
    assert_within_one_code(got, silu_and_mul_fp8_ref(gate_up), 128)


def test_silu_and_mul_fp8_strided_input_leading_dims_and_errors(poison):
    wide = randn(2, 3, 2 * 200 + 8, dtype=torch.bfloat16)
    gate_up = wide[..., :400]                               # rows 408 apart: read in place
    got = silu_and_mul_fp8(gate_up, 32)
    assert_same_act(got, fp8_quantize_act(silu_and_mul(gate_up).reshape(6, 200), 32), torch.bfloat16, (2, 3, 200))
    with pytest.raises(ValueError, match="16/32-bit"):
        silu_and_mul_fp8(randn(2, 7, dtype=torch.bfloat16))


# --- GPU: Qwen3-8B's shapes, eager and in CUDA graphs -----------------------------------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [8, 64, 512])
def test_gpu_fp8_feed_kernels_qwen3_8b(rows, dtype):
    for residual, zero_centered in ((True, False), (False, False), (True, True)):
        check_rms_norm_fp8(rows, 4096, dtype, residual, zero_centered)
    gate_up = randn(rows, 2 * 12288, dtype=dtype, scale=4.0)
    assert_same_act(silu_and_mul_fp8(gate_up), fp8_quantize_act(silu_and_mul(gate_up), 128), dtype, (rows, 12288))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 64, 512])
def test_gpu_fp8_feed_kernels_replay_in_cuda_graphs(rows):
    """Captured once, replayed with new inputs: the same bits as eager unfused calls."""
    x, r = randn(rows, 4096, dtype=torch.bfloat16), randn(rows, 4096, dtype=torch.bfloat16)
    gate_up = randn(rows, 2 * 12288, dtype=torch.bfloat16)
    w = norm_weight(4096, torch.bfloat16, False)
    graph, (act, res, swiglu) = captured(lambda: (*rms_norm_fp8(x, w, EPS, r), silu_and_mul_fp8(gate_up)))
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(randn(rows, 4096, dtype=torch.bfloat16, scale=1.0 + seed))
        r.copy_(randn(rows, 4096, dtype=torch.bfloat16))
        gate_up.copy_(randn(rows, 2 * 12288, dtype=torch.bfloat16, scale=2.0 + seed))
        graph.replay()
        torch.cuda.synchronize()
        normed, new_res = rms_norm(x, w, EPS, r)
        assert_same_act(act, fp8_quantize_act(normed, 128), torch.bfloat16, (rows, 4096))
        assert torch.equal(res, new_res)
        assert_same_act(swiglu, fp8_quantize_act(silu_and_mul(gate_up), 128), torch.bfloat16, (rows, 12288))
