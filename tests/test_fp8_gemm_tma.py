"""The TMA-fed W8A8 GEMM (`kernels/fp8_gemm.py`, `Fp8GemmConfig.tma`): bit for bit the pointer path's result at the
same tile and split (the same dots in the same order), and the fp64 W8A8 reference, at odd shapes (rows 1 / 3 / 5 /
17 / 64, N not a multiple of the tile, a partial last K block, bias, packed shards with a row_block, weight scale
rows not uniform over a tile, split-K off, fixed and planned, fp16 / bf16 / fp32 out); the pointer path where a
descriptor cannot address x or W. On Triton's CPU interpreter (which runs host-side tensor descriptors and reads
boxes past the end as zeros, as TMA does) and on the GPU (Qwen3-8B's shapes, every TMA candidate, CUDA-graph replay).
tests/fp8_launches.py records these tests' launches for the sm_90 compile check of tests/test_fp8_codegen.py.
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, gpu, poison_allocations, randn
from test_fp8_kernels import check, fp8_weight, needs_kernels
from orinfer.kernels import fp8_gemm as fp8_gemm_module
from orinfer.kernels import splitk
from orinfer.kernels.fp8_block import fp8_block_linear_a8_ref
from orinfer.kernels.fp8_gemm import CANDIDATES, Fp8GemmConfig, fp8_gemm
from orinfer.kernels.fp8_quant import fp8_quantize_act


@pytest.fixture
def tma_calls(monkeypatch) -> list:
    """NaN-poisoned allocations, and the list of what each `fp8_gemm` call's `_tma_operands` returned (None: the
    pointer path ran)."""
    poison_allocations(monkeypatch)
    calls = []
    operands = fp8_gemm_module._tma_operands

    def spy(*args):
        calls.append(operands(*args))
        return calls[-1]

    monkeypatch.setattr(fp8_gemm_module, "_tma_operands", spy)
    return calls


def a8_ref(x, weight, scale, block, row_block=None, bias=None) -> torch.Tensor:
    """The fp64 W8A8 reference (x quantized per token and group, the weight's blocks dequantised) on DEVICE."""
    cpu = (lambda t: None if t is None else t.cpu())
    return fp8_block_linear_a8_ref(x.double().cpu(), weight.cpu(), scale.cpu(), block, cpu(row_block),
                                   None if bias is None else bias.double().cpu()).to(DEVICE)


def both_paths(xq, xs, weight, scale, block, dtype, row_block, bias, cfg, tma_calls, tma_runs: bool):
    """(pointer path, TMA config) results of one call each; checks that the TMA config ran TMA iff `tma_runs`."""
    pointer = fp8_gemm(xq, xs, weight, scale, block, dtype, row_block, bias, cfg=cfg)
    assert not tma_calls
    tma = fp8_gemm(xq, xs, weight, scale, block, dtype, row_block, bias, cfg=cfg._replace(tma=True))
    assert len(tma_calls) == 1 and (tma_calls[0] is not None) == tma_runs
    return pointer, tma


@needs_kernels
@pytest.mark.parametrize("rows,n,k,block,dtype,bias,shards,cfg", [
    (1, 100, 272, (128, 128), torch.bfloat16, True, 1, Fp8GemmConfig(64, 64, 128, 4, 3, 1)),
    (3, 130, 400, (128, 128), torch.float16, False, 1, Fp8GemmConfig(64, 32, 128, 4, 4, 2)),
    (17, 96, 256, (32, 64), torch.bfloat16, True, 2, Fp8GemmConfig(64, 64, 128, 4, 3, 0)),
    (5, 96, 320, (32, 64), torch.float16, False, 1, Fp8GemmConfig(16, 64, 64, 4, 2, 2)),
    (64, 200, 208, (128, 128), torch.float16, True, 1, Fp8GemmConfig(64, 128, 128, 4, 4, 0)),
    (64, 256, 1152, (128, 128), torch.float32, False, 1, Fp8GemmConfig(64, 64, 128, 4, 6, 0)),
])
def test_tma_matches_the_pointer_path_bit_for_bit(rows, n, k, block, dtype, bias, shards, cfg, tma_calls):
    """Also: a row_block (17 rows: packed shards) and bn % BLOCK_N != 0 (5 rows) read their scales by rows, split-K
    leaves its counters at zero. The 5-row case's block_k is 64 (bk); the last one's K of 9 steps is planned into
    splits (`splitk.plan` at 4 tiles)."""
    weight, scale, row_block, _ = fp8_weight(n, k, block, shards)
    b = randn(n, dtype=dtype, scale=0.1) if bias else None
    x = randn(rows, k, dtype=dtype)
    xq, xs = fp8_quantize_act(x, block[1])
    pointer, tma = both_paths(xq, xs[:rows], weight, scale, block, dtype, row_block, b, cfg, tma_calls, True)
    assert torch.equal(tma, pointer)
    check(tma, a8_ref(x, weight, scale, block, row_block, b), dtype)
    assert not splitk.counters(xq.device).any()


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of row-major t whose base address is 8 bytes past a 16-byte boundary (same shape and strides)."""
    raw = torch.zeros(t.numel() + 16, dtype=torch.uint8, device=t.device)
    start = (-raw.data_ptr()) % 16 + 8
    view = raw[start:start + t.numel()].view(t.dtype).view(t.shape)
    view.view(torch.uint8).copy_(t.view(torch.uint8))
    return view


@needs_kernels
@pytest.mark.parametrize("where", ["row stride", "x base", "weight base"])
def test_tma_falls_back_to_pointers_where_descriptors_cannot_address(where, tma_calls):
    """TMA needs 16-byte aligned bases and row strides: K = 200 (a row of 200 bytes), or x or W at an address 8 bytes
    off, run the pointer path (the same result)."""
    n, k, rows, block = 96, 200 if where == "row stride" else 256, 3, (128, 128)
    weight, scale, _, _ = fp8_weight(n, k, block)
    x = randn(rows, k, dtype=torch.bfloat16)
    xq, xs = fp8_quantize_act(x, 128)
    if where == "x base":
        xq = _misaligned(xq)
    elif where == "weight base":
        weight = _misaligned(weight)
    assert (xq.data_ptr() % 16, weight.data_ptr() % 16) == ((8 if where == "x base" else 0),
                                                            (8 if where == "weight base" else 0))
    cfg = Fp8GemmConfig(64, 64, 128, 4, 3, 2)
    pointer, tma = both_paths(xq, xs[:rows], weight, scale, block, torch.bfloat16, None, None, cfg, tma_calls, False)
    assert torch.equal(tma, pointer)
    check(tma, a8_ref(x, weight, scale, block), torch.bfloat16)


def test_tma_candidates_and_config_strings():
    """The TMA candidates are 64-row tiles (decode batches); a config's string names `tma` only when on, so the
    sweep tables of configs without it read as before."""
    tma = [c for c in CANDIDATES if c.tma]
    assert len(tma) == 5 and all(c.block_m == 64 and c.split_k == 0 for c in tma)
    assert not fp8_gemm_module.PREFILL.tma
    assert str(Fp8GemmConfig(64, 64, 128, 4, 3, 0)) == ("Fp8GemmConfig(block_m=64, block_n=64, block_k=128, "
                                                        "num_warps=4, num_stages=3, split_k=0)")
    assert str(Fp8GemmConfig(64, 64, 128, 4, 3, 0, True)).endswith("split_k=0, tma=True)")


def test_decode_batch_tiles_follow_the_measured_table():
    """`small_m_config`: 16- and 32-row pointer tiles up to 16 and 32 rows; 64-row TMA tiles beyond, 64 columns wide
    only where N gives two tiles an SM (Qwen3-8B on 132 SMs: gate_up), else 32 (fp8_gemm.py's table, run 365)."""
    pick = fp8_gemm_module.small_m_config
    assert pick(2, 4096, 132) == pick(16, 24576, 132) == Fp8GemmConfig(16, 64, 128, 4, 4, 0)
    assert pick(17, 4096, 132) == pick(32, 24576, 132) == Fp8GemmConfig(32, 64, 128, 4, 4, 0)
    assert pick(33, 24576, 132) == pick(64, 24576, 132) == Fp8GemmConfig(64, 64, 128, 4, 4, 0, True)
    assert pick(64, 6144, 132) == pick(48, 4096, 132) == Fp8GemmConfig(64, 32, 128, 4, 4, 0, True)
    assert pick(64, 16896, 132).block_n == 64 and pick(64, 16832, 132).block_n == 32


# --- GPU: Qwen3-8B's shapes, every TMA candidate, CUDA graphs -------------------------------------------------------

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 17, 64])
@pytest.mark.parametrize("shape", sorted(QWEN3_8B))
def test_gpu_tma_candidates_qwen3_8b_shapes(rows, shape, tma_calls):
    """Every TMA candidate: TMA ran, bit for bit its pointer twin's result (the same wgmma chain per K step), close to
    the fp64 W8A8 reference."""
    n, k = QWEN3_8B[shape]
    weight, scale, _, _ = fp8_weight(n, k, (128, 128))
    x = randn(rows, k, dtype=torch.bfloat16)
    want = a8_ref(x, weight, scale, (128, 128))
    xq, xs = fp8_quantize_act(x, 128)
    for cfg in (c for c in CANDIDATES if c.tma):
        tma_calls.clear()
        pointer, tma = both_paths(xq, xs[:rows], weight, scale, (128, 128), torch.bfloat16, None, None,
                                  cfg._replace(tma=False), tma_calls, True)
        assert torch.equal(tma, pointer), f"{cfg}: differs from the pointer path"
        check(tma, want, torch.bfloat16, 2)
    assert not splitk.counters(xq.device).any()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_tma_gemm_replays_in_a_cuda_graph(rows):
    """Quantize + TMA GEMM captured once (the host-side descriptors go into the graph by value), replayed with new
    inputs: the results equal eager calls, the split-K counters stay at zero."""
    weight, scale, _, _ = fp8_weight(4096, 4096, (128, 128))
    x = randn(rows, 4096, dtype=torch.bfloat16)
    cfg = Fp8GemmConfig(64, 64, 128, 4, 4, 0, True)

    def call():
        xq, xs = fp8_quantize_act(x, 128)
        return fp8_gemm(xq, xs[:rows], weight, scale, (128, 128), torch.bfloat16, cfg=cfg)

    call()                                                          # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call()
    for seed in range(3):
        x.copy_(randn(rows, 4096, dtype=torch.bfloat16, scale=1.0 + seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, call())
    assert not splitk.counters(x.device).any()
