"""FP8 block-wise kernels (decode GEMV, W8A16 tensor-core MMA with split-K, activation quantization, W8A8 GEMM, the
row-count dispatch) against fp64 references, at odd shapes (N, K not multiples of the block, rows 1..300) with NaN-
poisoned outputs; on Triton's CPU interpreter (small shapes, explicit small-program tiles) and on the GPU (marked gpu,
Qwen3-8B shapes, every tile a sweep may promote, CUDA-graph replay, a tiny model against the torch backend).

The interpreter runs no PTX: the W8A16 MMA's bf16 and fp16 unpacking (`fp8_mm` modes A16_BF16 / A16_FP16) and
torch._scaled_mm are GPU-only; their arithmetic is checked on the CPU (`test_e4m3_to_bf16_bits`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernel_checks import (DEVICE, INTERPRET, assert_stored_as_kernels_round, compile_in_child, gpu,
                           poison_allocations, randn, tol)
from quant_packers import fp8_pack
from orinfer.fp8_config import FP8Config
from orinfer.kernels import fp8_ops, splitk
from orinfer.kernels.activation import silu_and_mul_ref
from orinfer.kernels.fp8_dequant import fp8_dequantize
from orinfer.kernels.fp8_block import (fp8_block_dequantize_ref, fp8_block_linear_a8_ref, fp8_block_quantize,
                                       fp8_quantize_act_ref)
from orinfer.kernels.fp8_gemm import CANDIDATES as GEMM_CANDIDATES
from orinfer.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm
from orinfer.kernels.fp8_gemv import CANDIDATES as GEMV_CANDIDATES
from orinfer.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv
from orinfer.kernels.fp8_mm import CANDIDATES as MM_CANDIDATES
from orinfer.kernels.fp8_mm import DECODE_128, Fp8MmConfig, decode_config, fp8_mm
from orinfer.kernels.fp8_quant import fp8_quantize_act
from orinfer.layers.linear_types import make_linear
from orinfer.layers.ops import TORCH_OPS

needs_kernels = pytest.mark.skipif(DEVICE.type == "cpu" and not INTERPRET, reason="no CUDA and no TRITON_INTERPRET")


@pytest.fixture
def poison(monkeypatch):
    poison_allocations(monkeypatch)


def fp8_weight(n: int, k: int, block: tuple[int, int], shards: int = 1, seed: int = 0):
    """(weight, scale, row_block, W fp64) on DEVICE: random W [n, k] / sqrt(k) quantized block-wise; shards > 1 packs
    that many shards of n / shards rows the way a packed layer stores them (each shard's own scale rows, row_block
    mapping rows to them where a shard does not divide by bn)."""
    gen = torch.Generator().manual_seed(seed)
    if shards == 1:
        q, scale = fp8_block_quantize(torch.randn(n, k, generator=gen) / k**0.5, block)
        row_block = None
    else:
        layer = make_linear(FP8Config(block_size=block), k, {i: n // shards for i in range(shards)}, False, TORCH_OPS,
                            torch.float32)
        for i in range(shards):
            q, scale, _ = fp8_pack(torch.randn(n // shards, k, generator=gen) / k**0.5, block)
            layer.weight.weight_loader(layer.weight, q, i, "w")
            layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, i, "s")
        q, scale, row_block = layer.weight.data, layer.weight_scale_inv.data, layer.row_block
    deq = fp8_block_dequantize_ref(q, scale, block, row_block, torch.float64)
    to = (lambda t: None if t is None else t.to(DEVICE))
    return to(q), to(scale), to(row_block), deq.to(DEVICE)


def w8a16_ref(x: torch.Tensor, deq: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """fp64 x W^T (+ b); gated: SwiGLU of it with g and u rounded to x's dtype first (the unfused path's roundings)."""
    y = x.double() @ deq.t()
    if bias is not None:
        y += bias.double()
    if gated:
        y = silu_and_mul_ref(y.to(x.dtype)).double()
    return y


def dispatch_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, deq: torch.Tensor,
                 block: tuple[int, int], gated: bool = False) -> torch.Tensor:
    """The fp64 reference of the path `fp8_ops.linear_path` names for this call (no row_block, no bias): x quantized
    (W8A8) on "scaled_mm" / "w8a8", else `w8a16_ref`; gated, the linear rounded to x's dtype, then SwiGLU, as the
    dispatch applies `silu_and_mul` after it."""
    if fp8_ops.linear_path(x, weight, scale, block, None, gated).removesuffix("+silu") not in ("scaled_mm", "w8a8"):
        return w8a16_ref(x, deq, None, gated)
    y = fp8_block_linear_a8_ref(x.double(), weight, scale, block)
    return silu_and_mul_ref(y.to(x.dtype)).double() if gated else y


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **tol(dtype, scale))


def test_one_row_tile_by_shape():
    """`fp8_gemv.default_config`: 2 rows x 2048 on 4 warps when a side is <= 2048 and rows are >= 2048 inputs (the
    H100 sweep of NOTES run 349: Qwen3.5-35B-A3B's projections), the older tile for wider weights (Qwen3-8B) and for
    short rows (not measured), the gated tile for a packed gate_up."""
    from orinfer.kernels import fp8_gemv

    for n, k in ((9216, 2048), (12352, 2048), (2048, 4096)):
        assert fp8_gemv.default_config(n, k) == fp8_gemv.SHORT
    for n, k in ((6144, 4096), (4096, 4096), (4096, 12288), (4096, 1024), (2048, 1024)):
        assert fp8_gemv.default_config(n, k) == fp8_gemv.DEFAULT
    assert fp8_gemv.default_config(12288, 4096, gated=True) == fp8_gemv.DEFAULT_GATED


def test_e4m3_to_bf16_bits():
    """The W8A16 MMA's unpacking (`fp8_mm._E4M3_TO_BF16`, PTX the interpreter cannot run): per byte b, the 16 bits
    (b << 4) + (b & 0x80) * 240 read as bf16 are the e4m3 value of b times 2^-120, for every code but NaN."""
    from orinfer.kernels import fp8_mm

    asm = fp8_mm._e4m3_to_bf16_asm()
    assert "0x00800080" in asm and "shl.b32 v, u, 4" in asm and "s, 240, v" in asm
    b = torch.arange(256, dtype=torch.int32)
    bits = ((b << 4) + (b & 0x80) * 240).to(torch.int16)          # bit 15 set wraps to the negative int16: same bits
    got = bits.view(torch.bfloat16).double()
    want = b.to(torch.uint8).view(torch.float8_e4m3fn).double() * 2.0 ** -120
    finite = want.isfinite()
    assert finite.sum() == 254 and torch.equal(got[finite], want[finite])


# --- one row: the CUDA-core GEMV ------------------------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("n,k,block,dtype,bias,shards,gated,cfg,rows", [
    (37, 70, (16, 32), torch.float32, True, 1, False, Fp8GemvConfig(16, 64, 1), 1),
    (130, 200, (128, 128), torch.bfloat16, False, 1, True, Fp8GemvConfig(16, 128, 2), 1),
    (48, 96, (16, 48), torch.float16, True, 2, False, Fp8GemvConfig(8, 32, 1), 1),
    (96, 384, (32, 128), torch.bfloat16, False, 2, True, None, 1),
    (24, 256, (128, 128), torch.float16, False, 1, False, None, 1),
    # Two rows (one pass over the weight for both): partial blocks and steps, shards, gated, bias.
    (37, 70, (16, 32), torch.float32, True, 1, False, Fp8GemvConfig(16, 64, 1), 2),
    (130, 200, (128, 128), torch.bfloat16, False, 1, True, Fp8GemvConfig(16, 128, 2), 2),
    (48, 96, (16, 48), torch.float16, True, 2, False, Fp8GemvConfig(8, 32, 1), 2),
    (96, 384, (32, 128), torch.bfloat16, False, 2, True, None, 2),
])
def test_fp8_gemv(n, k, block, dtype, bias, shards, gated, cfg, rows, poison):
    weight, scale, row_block, deq = fp8_weight(n, k, block, shards)
    n_out = n // 2 if gated else n
    b = randn(n_out, dtype=dtype, scale=0.1) if bias else None
    x = randn(rows, k, dtype=dtype)
    got = fp8_gemv(x, weight, scale, block, row_block, b, gated=gated, cfg=cfg)
    check(got, w8a16_ref(x, deq, b, gated), dtype)


# --- a few rows: the W8A16 tensor-core kernel, split-K ---------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("rows,n,k,block,dtype,bias,shards,gated,cfg", [
    (1, 37, 70, (16, 32), torch.float32, True, 1, False, Fp8MmConfig(16, 32, 32, 4, 1, 2)),
    (3, 130, 200, (128, 128), torch.bfloat16, False, 1, False, Fp8MmConfig(16, 64, 64, 4, 1, 3)),
    (8, 96, 256, (16, 48), torch.float16, True, 2, False, Fp8MmConfig(16, 32, 64, 4, 1, 0)),
    (17, 130, 200, (128, 128), torch.bfloat16, False, 1, True, Fp8MmConfig(32, 64, 128, 4, 1, 2)),
    (64, 256, 384, (128, 128), torch.float16, False, 2, True, Fp8MmConfig(64, 64, 128, 4, 1, 3)),
    (8, 256, 256, (128, 128), torch.bfloat16, True, 1, False, None),
])
def test_fp8_mm(rows, n, k, block, dtype, bias, shards, gated, cfg, poison):
    weight, scale, row_block, deq = fp8_weight(n, k, block, shards)
    n_out = n // 2 if gated else n
    b = randn(n_out, dtype=dtype, scale=0.1) if bias else None
    x = randn(rows, k, dtype=dtype)
    got = fp8_mm(x, weight, scale, block, row_block, b, gated=gated, cfg=cfg)
    check(got, w8a16_ref(x, deq, b, gated), dtype)


@needs_kernels
def test_split_k_is_deterministic_and_leaves_the_counters_at_zero():
    weight, scale, _, _ = fp8_weight(130, 512, (128, 128))
    x = randn(5, 512, dtype=torch.float32)
    cfg = Fp8MmConfig(16, 64, 64, 4, 1, 4)
    first = fp8_mm(x, weight, scale, (128, 128), cfg=cfg)
    assert torch.equal(fp8_mm(x, weight, scale, (128, 128), cfg=cfg), first)
    assert not splitk.counters(x.device).any()


# --- prefill: activation quantization and the W8A8 GEMM -------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("rows,k,group,dtype", [(1, 200, 128, torch.bfloat16), (3, 256, 32, torch.float32),
                                                (17, 100, 16, torch.float16), (6, 384, 128, torch.float16)])
def test_fp8_quantize_act(rows, k, group, dtype, poison):
    x = randn(rows, k, dtype=dtype, scale=30.0)
    x[0, :group] = 0                                              # an all-zero group: scale 1
    q, s = fp8_quantize_act(x, group)
    want_q, want_s = fp8_quantize_act_ref(x, group)
    pad = -(-rows // 4) * 4
    assert q.shape == (pad, k) and s.shape == (pad, -(-k // group)) and s.stride() == (1, pad)
    assert torch.equal(s[:rows], want_s) and torch.equal(q[:rows].view(torch.uint8), want_q.view(torch.uint8))
    assert not q[rows:].view(torch.uint8).any() and (s[rows:] == 1).all()


@needs_kernels
@pytest.mark.parametrize("rows,n,k,block,dtype,bias,shards,cfg", [
    (17, 130, 200, (128, 128), torch.bfloat16, True, 1, Fp8GemmConfig(32, 64, 128, 4, 1)),
    (64, 96, 256, (32, 64), torch.float16, False, 2, Fp8GemmConfig(16, 32, 64, 4, 1, 0)),
    (300, 130, 256, (128, 128), torch.bfloat16, False, 1, None),
    (5, 256, 384, (128, 128), torch.float16, True, 1, Fp8GemmConfig(16, 64, 128, 4, 1, 3)),
])
def test_fp8_gemm(rows, n, k, block, dtype, bias, shards, cfg, poison):
    weight, scale, row_block, _ = fp8_weight(n, k, block, shards)
    b = randn(n, dtype=dtype, scale=0.1) if bias else None
    x = randn(rows, k, dtype=dtype)
    xq, xs = fp8_quantize_act(x, block[1])
    got = fp8_gemm(xq, xs[:rows], weight, scale, block, dtype, row_block, b, cfg=cfg)
    want = fp8_block_linear_a8_ref(x.double().cpu(), weight.cpu(), scale.cpu(), block,
                                   None if row_block is None else row_block.cpu(),
                                   None if b is None else b.double().cpu()).to(DEVICE)
    check(got, want, dtype)


@needs_kernels
@pytest.mark.parametrize("n,k,block,shards,dtype", [(130, 200, (128, 128), 1, torch.bfloat16),
                                                    (96, 300, (32, 64), 2, torch.float16),
                                                    (256, 512, (128, 128), 1, torch.float32)])
def test_fp8_dequantize_matches_the_reference_bit_for_bit(n, k, block, shards, dtype, poison):
    weight, scale, row_block, _ = fp8_weight(n, k, block, shards)
    got = fp8_dequantize(weight, scale, block, row_block, dtype)
    exact = fp8_block_dequantize_ref(weight.cpu(), scale.cpu(), block, None if row_block is None else row_block.cpu())
    assert_stored_as_kernels_round(got, exact, dtype)


# --- the dispatch by row count --------------------------------------------------------------------------------------

_PATHS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from fp8_launches import dispatch_paths
print(json.dumps(dispatch_paths()))
"""


def _path_events(path: str, rows: int, gated: bool) -> list[str]:
    """What the dispatch runs on `path` (`fp8_launches._event`'s names): gated "ref" / "gemv" / "mma" are the fused
    reference and kernels, a "+silu" path its linear then `silu_and_mul`."""
    linear, unfused = path.removesuffix("+silu"), path.endswith("+silu")
    fused = " gated" if gated and not unfused else ""
    events = {"ref": ["gate_up_ref" if fused else "linear_ref"], "gemv": [f"fp8_gemv{fused}"],
              "mma": [f"fp8_mm{fused} BLOCK_M={decode_config(rows).block_m}"],
              "mma128": [f"fp8_mm BLOCK_M={DECODE_128.block_m}"], "w8a8": ["quant", "fp8_gemm"],
              "scaled_mm": ["quant", "scaled_mm"], "dequant": ["dequant", "linear"]}[linear]
    return events + ["silu_and_mul"] * unfused


@pytest.fixture(scope="module")
def dispatch_paths() -> list[dict]:
    """`fp8_launches.dispatch_paths`: recorded with empty CPU tensors in a child process without the interpreter."""
    return compile_in_child(_PATHS, str(Path(__file__).parent))


def test_linear_path_names_what_the_dispatch_runs(dispatch_paths):
    """`fp8_ops.linear_path` against the Triton launches and host calls that fp8_block_linear / fp8_gate_up_silu make,
    over every combination of ONE_ROW, SMALL_M and PREFILL, the device probe passing or not, four dtypes, block shapes
    and row counts 0..300; every path is taken somewhere."""
    cases = dispatch_paths
    wrong = [c for c in cases if c["events"] != _path_events(c["path"], c["rows"], c["gated"])]
    assert not wrong, f"{len(wrong)} of {len(cases)} calls run another path than linear_path names: {wrong[:3]}"
    paths = {"ref", "gemv", "mma", "mma128", "w8a8", "scaled_mm", "dequant"}
    assert {c["path"] for c in cases} == paths | {f"{p}+silu" for p in paths - {"gemv"}}


# (settings other than the defaults, probe passes, dtype, block, rows, gated, path): the module docstring's rules.
_DOCUMENTED_PATHS = [
    ({}, True, "bfloat16", (128, 128), 1, True, "gemv"),
    ({"ONE_ROW": "mma"}, True, "bfloat16", (128, 128), 1, True, "mma"),
    ({"ONE_ROW": "mma", "SMALL_M": "w8a8"}, True, "bfloat16", (128, 128), 1, False, "mma"),
    ({"ONE_ROW": "mma", "SMALL_M": "w8a8"}, True, "bfloat16", (128, 128), 1, True, "mma+silu"),
    ({}, True, "bfloat16", (128, 128), 64, True, "mma"),
    # Decode rows where _scaled_mm would run take the Triton GEMM's small-M tile (faster at M = 64, runs 359/363).
    ({"SMALL_M": "w8a8"}, True, "bfloat16", (128, 128), 8, False, "w8a8"),
    ({"SMALL_M": "w8a8"}, True, "bfloat16", (128, 128), 64, True, "w8a8+silu"),
    # W8A8 decode rows without a block-scaled _scaled_mm (fp16 x, or the probe failing) keep the W8A16 kernel
    # rather than dequantising whole weights every step; more rows than a decode batch do dequantise.
    ({"SMALL_M": "w8a8"}, True, "float16", (128, 128), 8, True, "mma"),
    ({"SMALL_M": "w8a8"}, False, "bfloat16", (128, 128), 64, False, "mma"),
    ({"SMALL_M": "w8a8"}, True, "float16", (128, 128), 65, True, "dequant+silu"),
    ({"SMALL_M": "w8a8", "PREFILL": "triton"}, True, "float16", (128, 128), 8, True, "w8a8+silu"),
    # Two rows (a draft model's catch-up) stay on the GEMV: one pass over the weight for both.
    ({"SMALL_M": "w8a8"}, True, "bfloat16", (128, 128), 2, True, "gemv"),
    ({"SMALL_M": "w8a8", "ONE_ROW": "mma"}, True, "bfloat16", (128, 128), 2, False, "w8a8"),
    ({"SMALL_M": "w8a8", "PREFILL": "w8a16"}, True, "bfloat16", (128, 128), 8, False, "mma"),
    ({"SMALL_M": "w8a8"}, True, "float32", (128, 128), 8, True, "mma"),
    ({"SMALL_M": "w8a8"}, True, "bfloat16", (16, 48), 8, False, "mma"),
    ({}, True, "bfloat16", (128, 128), 300, True, "scaled_mm+silu"),
    ({}, False, "bfloat16", (128, 128), 65, False, "dequant"),
    ({"PREFILL": "scaled_mm"}, False, "float16", (128, 128), 300, False, "w8a8"),
    ({"PREFILL": "triton"}, True, "bfloat16", (16, 32), 300, False, "w8a8"),
    ({"PREFILL": "triton"}, True, "bfloat16", (16, 48), 300, False, "mma128"),
    ({"PREFILL": "w8a16"}, True, "float16", (128, 128), 300, True, "mma128+silu"),
    ({"PREFILL": "dequant"}, True, "bfloat16", (128, 128), 300, False, "dequant"),
    ({"PREFILL": "dequant"}, True, "float32", (128, 128), 300, True, "ref+silu"),
    ({}, True, "float64", (128, 128), 8, True, "ref"),
    ({}, True, "bfloat16", (16, 24), 8, False, "ref"),
    ({}, True, "bfloat16", (128, 128), 0, True, "ref"),
]


def test_linear_path_follows_the_documented_rules(dispatch_paths):
    """Representative calls take the paths the module docstring gives (128 x 128 blocks: Qwen3-8B's o)."""
    by_call = {(json.dumps(c["setting"], sort_keys=True), c["probe"], c["dtype"], tuple(c["block"]), c["rows"],
                c["gated"]): c["path"] for c in dispatch_paths if c["n"] in (4096, 38, 96, 40)}   # one shape per block
    for changed, probe, dtype, block, rows, gated, path in _DOCUMENTED_PATHS:
        setting = json.dumps({"ONE_ROW": "fma", "SMALL_M": "w8a16", "PREFILL": "auto"} | changed, sort_keys=True)
        key = (setting, probe, f"torch.{dtype}", block, rows, gated)
        assert by_call[key] == path, key


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 300])
def test_fp8_ops_by_row_count(rows, poison):
    """fp8_block_linear / fp8_gate_up_silu against the reference of the path they take: W8A16 kernels up to
    MMA_MAX_ROWS rows; beyond, _scaled_mm (W8A8) where it runs, else the dequantised weight (x as it is)."""
    k, n, block, dtype = 256, 64, (128, 128), torch.bfloat16
    weight, scale, _, deq = fp8_weight(n, k, block)
    x = randn(1, rows, k, dtype=dtype)
    check(fp8_ops.fp8_block_linear(x, weight, scale, block), dispatch_ref(x, weight, scale, deq, block), dtype)
    check(fp8_ops.fp8_gate_up_silu(x, weight, scale, block), dispatch_ref(x, weight, scale, deq, block, True), dtype)


@needs_kernels
def test_fp8_ops_prefill_through_the_triton_w8a8_gemm(monkeypatch, poison):
    monkeypatch.setattr(fp8_ops, "PREFILL", "triton")
    k, n, block, rows, dtype = 256, 64, (128, 128), 300, torch.bfloat16
    weight, scale, _, _ = fp8_weight(n, k, block)
    x = randn(1, rows, k, dtype=dtype)
    want = fp8_block_linear_a8_ref(x.double().cpu(), weight.cpu(), scale.cpu(), block).to(DEVICE)
    check(fp8_ops.fp8_block_linear(x, weight, scale, block), want, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_ops_prefill_through_dequantize(dtype, monkeypatch, poison):
    """PREFILL = "dequant": beyond MMA_MAX_ROWS, x (not quantized) times the weight dequantised to x's dtype."""
    monkeypatch.setattr(fp8_ops, "PREFILL", "dequant")
    k, n, block, rows = 256, 64, (128, 128), 300
    weight, scale, _, deq = fp8_weight(n, k, block)
    b = randn(n, dtype=dtype, scale=0.1)
    x = randn(1, rows, k, dtype=dtype)
    check(fp8_ops.fp8_block_linear(x, weight, scale, block, None, b), w8a16_ref(x, deq, b, False), dtype)


@needs_kernels
def test_fp8_ops_single_row_and_errors():
    weight, scale, _, deq = fp8_weight(40, 64, (128, 128))
    x = randn(1, 1, 64, dtype=torch.float32)
    check(fp8_ops.fp8_block_linear(x, weight, scale, (128, 128)), w8a16_ref(x, deq, None, False), torch.float32)
    with pytest.raises(ValueError, match="FP8 weight"):
        fp8_gemv(randn(1, 63, dtype=torch.float32), weight, scale, (128, 128))
    with pytest.raises(ValueError, match="do not fit"):
        fp8_mm(randn(2, 64, dtype=torch.float32), weight, scale[:, :0], (128, 128))
    with pytest.raises(ValueError, match="one or two rows"):
        fp8_gemv(randn(3, 64, dtype=torch.float32), weight, scale, (128, 128))
    with pytest.raises(ValueError, match="bk % 32"):
        xq, xs = fp8_quantize_act(randn(2, 64, dtype=torch.bfloat16), 16)
        fp8_gemm(xq, xs[:2], weight, torch.ones(1, 4, device=DEVICE), (128, 16), torch.bfloat16)


@needs_kernels
def test_fp16_results_clamp_in_every_kernel():
    """Qwen's activations can leave fp16's range: every FP8 kernel clamps fp16 results to +-65504."""
    weight, scale, _ = (t.to(DEVICE) for t in fp8_pack(torch.full((64, 128), 448.0), (128, 128)))
    want = torch.full((2, 64), 65504.0, dtype=torch.float16, device=DEVICE)
    x = torch.full((2, 128), 60000.0, dtype=torch.float16, device=DEVICE)
    assert torch.equal(fp8_gemv(x[:1], weight, scale, (128, 128)), want[:1])
    assert torch.equal(fp8_mm(x, weight, scale, (128, 128), cfg=Fp8MmConfig(16, 64, 128, 4, 1, 1)), want)
    xq, xs = fp8_quantize_act(x, 128)
    assert torch.equal(fp8_gemm(xq, xs[:2], weight, scale, (128, 128), torch.float16), want)


# --- GPU: Qwen3-8B shapes, every tile, CUDA graphs, a model ---------------------------------------------------------

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 12288)}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("small_m", ["w8a16", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 8, 17, 64])
@pytest.mark.parametrize("shape", sorted(QWEN3_8B))
def test_gpu_fp8_decode_qwen3_8b_shapes(dtype, rows, shape, small_m, monkeypatch):
    """The dispatch against the reference of its path under each SMALL_M (bf16 under "w8a8": W8A8, _scaled_mm where
    it runs), and the W8A16 MMA itself."""
    monkeypatch.setattr(fp8_ops, "SMALL_M", small_m)
    n, k = QWEN3_8B[shape]
    weight, scale, _, deq = fp8_weight(n, k, (128, 128))
    x = randn(rows, k, dtype=dtype)
    check(fp8_ops.fp8_block_linear(x, weight, scale, (128, 128)), dispatch_ref(x, weight, scale, deq, (128, 128)),
          dtype, 2)
    check(fp8_mm(x, weight, scale, (128, 128)), w8a16_ref(x, deq, None, False), dtype, 2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("small_m", ["w8a16", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_gpu_fp8_gate_up_qwen3_8b(dtype, rows, small_m, monkeypatch):
    monkeypatch.setattr(fp8_ops, "SMALL_M", small_m)
    weight, scale, _, deq = fp8_weight(2 * 12288, 4096, (128, 128))
    x = randn(rows, 4096, dtype=dtype)
    check(fp8_ops.fp8_gate_up_silu(x, weight, scale, (128, 128)),
          dispatch_ref(x, weight, scale, deq, (128, 128), gated=True), dtype, 2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 300, 2048])
@pytest.mark.parametrize("shape", sorted(QWEN3_8B))
def test_gpu_fp8_w8a8_qwen3_8b_shapes(rows, shape):
    """The Triton W8A8 GEMM and (where this torch runs it) torch._scaled_mm against the fp64 W8A8 reference."""
    n, k = QWEN3_8B[shape]
    weight, scale, _, _ = fp8_weight(n, k, (128, 128))
    x = randn(rows, k, dtype=torch.bfloat16)
    want = fp8_block_linear_a8_ref(x.double(), weight, scale, (128, 128))
    xq, xs = fp8_quantize_act(x, 128)
    check(fp8_gemm(xq, xs[:rows], weight, scale, (128, 128), torch.bfloat16), want, torch.bfloat16, 2)
    if fp8_ops._scaled_mm_runs(x.device):
        check(fp8_ops.fp8_scaled_mm(xq, xs, weight, scale, torch.bfloat16)[:rows], want, torch.bfloat16, 2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_every_fp8_config_is_correct(dtype):
    """Each tile a sweep (`orinfer.bench.fp8_kernels --sweep`) may promote to default computes the same thing."""
    weight, scale, _, deq = fp8_weight(1536, 2048, (128, 128))
    for rows, kernel, cfgs in ((1, fp8_gemv, GEMV_CANDIDATES), (8, fp8_mm, MM_CANDIDATES)):
        x = randn(rows, 2048, dtype=dtype)
        for gated in (False, True):
            want = w8a16_ref(x, deq, None, gated)
            for cfg in cfgs:
                got = kernel(x, weight, scale, (128, 128), gated=gated, cfg=cfg)
                torch.testing.assert_close(got.double(), want, **tol(dtype, 2), msg=lambda m: f"{cfg} {gated}: {m}")
    x = randn(300, 2048, dtype=dtype)
    xq, xs = fp8_quantize_act(x, 128)
    want = fp8_block_linear_a8_ref(x.double(), weight, scale, (128, 128))
    for cfg in GEMM_CANDIDATES:
        got = fp8_gemm(xq, xs[:300], weight, scale, (128, 128), dtype, cfg=cfg)
        torch.testing.assert_close(got.double(), want, **tol(dtype, 2), msg=lambda m: f"{cfg}: {m}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("small_m", ["w8a16", "w8a8"])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_gpu_fp8_kernels_replay_in_cuda_graphs(rows, small_m, monkeypatch):
    """Captured once, replayed with new inputs: the split-K counters reset, the results equal eager calls (SMALL_M
    "w8a8": the W8A8 decode path, quantization and _scaled_mm or the Triton GEMM, in the graph)."""
    monkeypatch.setattr(fp8_ops, "SMALL_M", small_m)
    weight, scale, _, _ = fp8_weight(4096, 4096, (128, 128))
    gu_weight, gu_scale, _, _ = fp8_weight(2 * 1536, 4096, (128, 128), seed=1)
    x = randn(rows, 4096, dtype=torch.bfloat16)
    fp8_ops.fp8_block_linear(x, weight, scale, (128, 128))          # compile outside the capture
    fp8_ops.fp8_gate_up_silu(x, gu_weight, gu_scale, (128, 128))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_ops.fp8_block_linear(x, weight, scale, (128, 128))
        g = fp8_ops.fp8_gate_up_silu(x, gu_weight, gu_scale, (128, 128))
    for seed in range(3):
        x.copy_(randn(rows, 4096, dtype=torch.bfloat16, scale=1.0 + seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, fp8_ops.fp8_block_linear(x, weight, scale, (128, 128)))
        assert torch.equal(g, fp8_ops.fp8_gate_up_silu(x, gu_weight, gu_scale, (128, 128)))
    assert not splitk.counters(x.device).any()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_gpu_fp8_model_triton_matches_torch_backend(tmp_path, cuda_graph):
    """A tiny FP8 Qwen3 (128 x 128 blocks, partial ones) on CUDA in fp32: the triton backend (GEMV, split-K MMA,
    fused gate/up, W8A16 prefill for fp32, CUDA graphs) gives the torch backend's greedy tokens, for one sequence and
    a batch of five."""
    from hf_models import build_hf_model, save_hf_model
    from quant_packers import write_fp8_checkpoint
    from quant_parity import assert_triton_matches_torch_on_cuda

    orig = save_hf_model(build_hf_model("qwen3-gqa4-untied"), tmp_path / "orig")
    write_fp8_checkpoint(orig, tmp_path / "fp8")
    assert_triton_matches_torch_on_cuda(tmp_path / "fp8", cuda_graph)


@gpu
@pytest.mark.gpu
def test_gpu_fp8_kernel_bench_runs(monkeypatch, tmp_path):
    """`python -m orinfer.bench.fp8_kernels --sweep --out DIR` end to end on small shapes (its sections, its sweep,
    the markdown and JSON files)."""
    import json

    from orinfer.bench import fp8_kernels

    monkeypatch.setattr(fp8_kernels, "SHAPES", {"o": (512, 256), "gate_up": (1024, 256)})
    assert fp8_kernels.main(["--iters", "2", "--sweep", "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "fp8-kernels.json").read_text())["rows"]
    assert {r["section"] for r in rows} == {"ceiling", "decode", "M=64", "prefill", "feed"}
    assert all(r["us"] > 0 for r in rows if r.get("us") is not None)
    assert "| decode: gate_up |" in (tmp_path / "out" / "fp8-kernels.md").read_text()


@pytest.mark.slow  # the whole model through Triton's CPU interpreter; CI's slow tier and the GPU run it
@needs_kernels
def test_triton_backend_runs_the_fp8_model_like_the_torch_backend(tmp_path):
    """A tiny FP8 Qwen3 (partial 128 x 128 blocks) through the Triton op table (FP8 GEMV and fused gate/up for decode,
    the tensor-core kernel for the prompt) gives the torch backend's logits and greedy tokens."""
    from hf_models import build_hf_model, save_hf_model
    from quant_packers import write_fp8_checkpoint
    from quant_parity import PROMPT, SMALL_KV
    from test_awq import _triton_llm
    from test_hf_parity import paged_logits
    from orinfer import LLM, SamplingParams

    orig = save_hf_model(build_hf_model("qwen3-gqa4-untied"), tmp_path / "orig")
    write_fp8_checkpoint(orig, tmp_path / "fp8")
    ref, tri = LLM(tmp_path / "fp8", **(SMALL_KV | dict(device=DEVICE.type))), _triton_llm(tmp_path / "fp8")
    ids = PROMPT + [4, 9]
    torch.testing.assert_close(paged_logits(tri, ids, len(PROMPT)), paged_logits(ref, ids, len(PROMPT)),
                               atol=1e-4, rtol=1e-4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert tri.generate([PROMPT], params)[0].token_ids == ref.generate([PROMPT], params)[0].token_ids
