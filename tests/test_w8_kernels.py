"""GPTQ-Int8 in the W8 layout (kernels/w8.py): the repack against GPTQ's definition and back, and the triton
backend's kernels (the FP8 GEMV / W8A16 MMA / dequantiser on uint8 codes, `kernels/w8_ops.py`) against fp64
references at odd shapes (N, K not multiples of the tiles, partial last groups, group sizes 32, 128 and whole rows,
act-order on and off, 1..300 rows) with NaN-poisoned outputs; on Triton's CPU interpreter and on the GPU (marked gpu:
Qwen3-8B's shapes, CUDA-graph replay).

References: W from the GPTQ codes by the format's definition in fp64, y = x W^T in fp64 (the unfused roundings of
SwiGLU for gate/up). The kernels sum exact fp32 products of q - z, x and s and round once, so the tolerance is about
one rounding of the output dtype (`kernel_checks.tol`); the prefill path rounds W to x's dtype first, as cuBLAS
multiplies 16-bit operands (well inside the same tolerance on O(1) outputs).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from kernel_checks import (DEVICE, INTERPRET, assert_stored_as_kernels_round, gpu, poison_allocations, randn,
                           tol)
from test_fp8_kernels import check, w8a16_ref
from orinfer.kernels import gptq, splitk, w8_ops
from orinfer.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv
from orinfer.kernels.fp8_mm import Fp8MmConfig, fp8_mm
from orinfer.kernels.gptq import pack_gptq_cols, pack_gptq_rows
from orinfer.kernels.w8 import W8Weight, gptq_to_w8, w8_dequantize_ref, w8_linear_ref, w8_to_gptq

needs_kernels = pytest.mark.skipif(DEVICE.type == "cpu" and not INTERPRET, reason="no CUDA and no TRITON_INTERPRET")


@pytest.fixture
def poison(monkeypatch):
    poison_allocations(monkeypatch)


def random_gptq8(n: int, k: int, group: int, desc_act: bool, seed: int = 0, device=DEVICE, sym: bool = False):
    """(GPTQ tensors {qweight, qzeros, scales, g_idx}, W fp64 [n, k]) of random 8-bit codes and stored zeros (every
    value 0..255, the extremes included: zero points 1 and 256; sym: all 127, symmetric GPTQ's) by the classic
    format's definition, W[n, k] = (q[k, n] - (z[g_idx[k], n] + 1)) * s[g_idx[k], n], with scales giving
    W ~ 1/sqrt(k) (outputs ~1). desc_act: groups over a random order of the inputs, as GPTQ's act-order makes them."""
    gen = torch.Generator().manual_seed(seed)
    g = k if group == -1 else group
    groups = math.ceil(k / g)
    q = torch.randint(0, 256, (k, n), generator=gen, dtype=torch.int32)
    stored = torch.randint(0, 256, (groups, n), generator=gen, dtype=torch.int32)
    stored[0, :2] = torch.tensor([0, 255])
    if sym:
        stored.fill_(127)
    s = ((torch.rand(groups, n, generator=gen) + 0.5) / (100 * math.sqrt(k))).half()
    order = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    gi = g_idx.long()
    w = ((q.double() - (stored.double()[gi] + 1)) * s.double()[gi]).t().contiguous()
    tensors = {"qweight": pack_gptq_rows(q, 8), "qzeros": pack_gptq_cols(stored, 8), "scales": s, "g_idx": g_idx}
    return {name: t.to(device) for name, t in tensors.items()}, w.to(device)


@functools.lru_cache(maxsize=8)     # the GPU tests' full-size weights take seconds to make: reused across cases
def w8_weight(n: int, k: int, group: int, desc_act: bool, seed: int = 0, sym: bool = False):
    """(W8 weight, perm or None, W fp64 [n, k] in the inputs' original order) on DEVICE (shared: not to be changed)."""
    t, w = random_gptq8(n, k, group, desc_act, seed, sym=sym)
    w8, perm = gptq_to_w8(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], k if group == -1 else group)
    return w8, perm, w


def permuted(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """x's columns in the W8 weight's input order (the layer's one gather)."""
    return x if perm is None else x.index_select(-1, perm)


# --- the layout -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,group,desc_act,sym", [
    (24, 64, 32, False, False), (40, 200, 32, True, False), (16, 256, 128, True, True), (8, 136, 128, False, False),
    (12, 36, -1, False, True), (20, 96, -1, True, False)])
@pytest.mark.parametrize("weights", [1 << 23, 1024])
def test_repack_dequantizes_identically_and_round_trips(n, k, group, desc_act, sym, weights, monkeypatch):
    """Also repacked 1024 weights at a time (`gptq.REPACK_WEIGHTS`: slices of whole columns, a partial last one)."""
    monkeypatch.setattr(gptq, "REPACK_WEIGHTS", weights)
    t, w = random_gptq8(n, k, group, desc_act, seed=n, device="cpu", sym=sym)
    w8, perm = gptq_to_w8(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], k if group == -1 else group)
    assert (perm is None) == (not desc_act or group == -1)   # one group: act-order changes nothing
    assert w8.codes.dtype == torch.uint8 and w8.codes.shape == (n, k) and w8.codes.is_contiguous()
    assert w8.scales.shape == (n, math.ceil(k / w8.group_size)) and w8.scales.stride(1) == 1
    if sym:                                                               # one zero point: an int, no tensor
        assert w8.zeros == 128 and isinstance(w8.zeros, int)
    else:
        assert w8.zeros.shape == w8.scales.shape and w8.zeros.stride() == w8.scales.stride()
        assert w8.zeros.min() >= 1 and w8.zeros.max() == 256             # GPTQ's stored 0 and 255
    dense = w8_dequantize_ref(w8, torch.float64)                          # W' [N, K]: inputs in perm's order
    if perm is not None:
        dense = torch.empty_like(dense).index_copy_(1, perm, dense)
    assert torch.equal(dense, w)
    back = w8_to_gptq(w8, perm)
    assert all(torch.equal(a, t[name]) for a, name in zip(back, ("qweight", "qzeros", "scales")))


def test_repack_refuses_groups_of_other_sizes():
    t, _ = random_gptq8(8, 64, 32, False, device="cpu")
    uneven = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32)         # groups of 40 and 24 inputs
    with pytest.raises(ValueError, match="groups of group_size"):
        gptq_to_w8(t["qweight"], t["qzeros"], t["scales"], uneven, 32)
    with pytest.raises(ValueError, match="do not fit"):
        gptq_to_w8(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 16)


def test_u8_to_f32_bits():
    """The byte -> fp32 PTX of `tiles.code_values` (which the interpreter cannot run), emulated by prmt's definition:
    result byte j is byte (selector nibble j & 7) of {c, input} (input bytes 0..3, c = 0x4B000000 bytes 4..7). For
    every code and position, the word is the fp32 2^23 + code."""
    from orinfer.kernels import tiles

    for pack in (2, 4):
        asm = tiles._u8_to_f32_asm(pack)
        lines = [line for line in asm.splitlines() if line.startswith("prmt.b32")]
        assert "mov.b32 c, 0x4B000000;" in asm and len(lines) == pack
        for i, line in enumerate(lines):
            out, src, c, sel = (part.strip(" ;") for part in line.removeprefix("prmt.b32").split(","))
            assert (out, src, c) == (f"${i}", f"${pack}", "c")
            for code in (0, 1, 127, 128, 255):
                word = sum(code << (8 * b) for b in range(4))            # the code in every byte of the input
                pool = word.to_bytes(4, "little") + (0x4B000000).to_bytes(4, "little")
                got = bytes(pool[(int(sel, 16) >> (4 * j)) & 7] for j in range(4))
                value = torch.tensor(int.from_bytes(got, "little"), dtype=torch.int64).to(torch.int32)
                assert value.view(torch.float32).item() == 2.0 ** 23 + code


# --- the kernels ------------------------------------------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("rows,n,k,group,desc_act,sym,dtype,bias,gated,cfg", [
    (1, 44, 200, 32, True, False, torch.float32, True, False, Fp8GemvConfig(16, 64, 1)),
    (1, 96, 256, 128, False, True, torch.bfloat16, False, True, Fp8GemvConfig(8, 128, 2)),
    (1, 40, 192, -1, True, False, torch.float16, True, False, None),
    (1, 48, 200, 32, True, True, torch.float32, False, False, None),
    (3, 44, 200, 32, False, False, torch.bfloat16, True, False, Fp8MmConfig(16, 32, 32, 4, 1, 2)),
    (3, 96, 264, 128, True, True, torch.float32, False, True, Fp8MmConfig(16, 32, 64, 4, 1, 3)),
    (16, 64, 192, -1, False, False, torch.float16, False, False, Fp8MmConfig(16, 64, 64, 4, 1, 0)),
    (16, 128, 160, 32, True, False, torch.bfloat16, False, True, None),
])
def test_w8_kernels(rows, n, k, group, desc_act, sym, dtype, bias, gated, cfg, poison):
    """The GEMV (1 row) and the W8A16 MMA (split-K and not) on uint8 codes, zero points per group or one for all
    (sym), explicit small tiles and the defaults."""
    w8, perm, w = w8_weight(n, k, group, desc_act, seed=rows, sym=sym)
    assert isinstance(w8.zeros, int) == sym
    n_out = n // 2 if gated else n
    b = randn(n_out, dtype=dtype, scale=0.1) if bias else None
    x = randn(rows, k, dtype=dtype)
    kernel = fp8_gemv if rows == 1 else fp8_mm
    got = kernel(permuted(x, perm), w8.codes, w8.scales, (1, w8.group_size), None, b, gated=gated, cfg=cfg,
                 zeros=w8.zeros)
    check(got, w8a16_ref(x, w, b, gated), dtype)


@needs_kernels
@pytest.mark.parametrize("rows,sym", [(1, False), (3, True), (16, False), (17, True), (64, False), (65, False),
                                      (300, True)])
def test_w8_ops_by_row_count(rows, sym, poison):
    """w8_linear / w8_gate_up_silu: GEMV, MMA up to MMA_MAX_ROWS rows, then the dequantised weight and cuBLAS (x as
    it is); act-order and a partial last group."""
    n, k, dtype = 48, 208, torch.bfloat16
    w8, perm, w = w8_weight(n, k, 32, True, seed=rows, sym=sym)
    b = randn(n, dtype=dtype, scale=0.1)
    x = randn(1, rows, k, dtype=dtype)
    check(w8_ops.w8_linear(permuted(x, perm), w8, b), w8a16_ref(x, w, b, False), dtype)
    check(w8_ops.w8_gate_up_silu(permuted(x, perm), w8), w8a16_ref(x, w, None, True), dtype)


@needs_kernels
def test_prefill_rows_take_the_tensor_core_kernel_when_asked(monkeypatch, poison):
    """ORINFER_W8_PREFILL=mma: 65+ rows run `fp8_mm` on the codes with 128-row tiles (checked by recording the call)
    and give the reference; an unknown setting is refused by name."""
    w8, perm, w = w8_weight(48, 208, 32, True, seed=3)
    x = randn(1, 70, 208, dtype=torch.bfloat16)
    monkeypatch.setattr(w8_ops, "PREFILL", "mma")
    calls = []
    real = w8_ops.fp8_mm
    monkeypatch.setattr(w8_ops, "fp8_mm", lambda *a, **kw: calls.append(kw.get("cfg")) or real(*a, **kw))
    check(w8_ops.w8_linear(permuted(x, perm), w8), w8a16_ref(x, w, None, False), torch.bfloat16)
    check(w8_ops.w8_gate_up_silu(permuted(x, perm), w8), w8a16_ref(x, w, None, True), torch.bfloat16)
    assert calls == [w8_ops.DECODE_128] * 2
    monkeypatch.setattr(w8_ops, "PREFILL", "dequantise")
    with pytest.raises(ValueError, match="ORINFER_W8_PREFILL"):
        w8_ops.w8_linear(x, w8)


@needs_kernels
def test_group_sizes_the_kernels_cannot_take_go_to_the_dequantised_weight(poison):
    """A whole-row group of 36 inputs (not a multiple of 16): every row count through dequantise + matmul."""
    w8, perm, w = w8_weight(24, 36, -1, False)
    for rows in (1, 5):
        x = randn(rows, 36, dtype=torch.float32)
        assert w8_ops._decode_kernel(x, w8) is None
        check(w8_ops.w8_linear(x, w8), w8a16_ref(x, w, None, False), torch.float32)
        check(w8_ops.w8_gate_up_silu(x, w8), w8a16_ref(x, w, None, True), torch.float32)


@needs_kernels
@pytest.mark.parametrize("n,k,group,sym,dtype", [
    (44, 200, 32, False, torch.bfloat16), (24, 136, 128, True, torch.float16), (16, 96, -1, False, torch.float32)])
def test_w8_dequantize_matches_the_reference_bit_for_bit(n, k, group, sym, dtype, poison):
    w8, _, _ = w8_weight(n, k, group, False, sym=sym)
    got = w8_ops.w8_dequantize(w8, dtype)
    exact = w8_dequantize_ref(W8Weight(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in w8[:3]),
                                       w8.group_size))
    assert_stored_as_kernels_round(got, exact, dtype)


@needs_kernels
def test_fp16_results_clamp_and_errors():
    w8 = W8Weight(torch.full((32, 64), 255, dtype=torch.uint8, device=DEVICE),
                  torch.ones(32, 2, dtype=torch.float16, device=DEVICE),
                  torch.zeros(32, 2, dtype=torch.float16, device=DEVICE), 32)
    for rows in (1, 2, 100):
        x = torch.full((rows, 64), 60000.0, dtype=torch.float16, device=DEVICE)
        assert torch.equal(w8_ops.w8_linear(x, w8), torch.full((rows, 32), 65504.0, dtype=torch.float16,
                                                                  device=DEVICE))
    x = randn(1, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="zero points"):
        fp8_gemv(x, w8.codes, w8.scales, (1, 32), zeros=w8.zeros[:, :1])
    with pytest.raises(ValueError, match="W8 weight"):
        fp8_mm(x, w8.codes.view(torch.int8), w8.scales, (1, 32), zeros=w8.zeros)


# --- GPU: Qwen3-8B's shapes, CUDA graphs ---------------------------------------------------------------------------

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 12288)}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 8, 16, 17, 64, 65, 300])
@pytest.mark.parametrize("shape", sorted(QWEN3_8B))
def test_gpu_w8_qwen3_8b_shapes(dtype, rows, shape):
    """Every path of the dispatch (GEMV, MMA, dequantise + cuBLAS) on Qwen3-8B's shapes, groups of 128 with act-order
    and symmetric zero points (GPTQ-Int8's published setting); zero points per group at one and 64 rows."""
    n, k = QWEN3_8B[shape]
    w8, perm, w = w8_weight(n, k, 128, True, sym=rows not in (1, 64))
    x = randn(rows, k, dtype=dtype)
    check(w8_ops.w8_linear(permuted(x, perm), w8), w8a16_ref(x, w, None, False), dtype, 2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_gpu_w8_gate_up_qwen3_8b(dtype, rows):
    w8, perm, w = w8_weight(2 * 12288, 4096, 128, True, sym=rows != 8)
    x = randn(rows, 4096, dtype=dtype)
    check(w8_ops.w8_gate_up_silu(permuted(x, perm), w8), w8a16_ref(x, w, None, True), dtype, 2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_every_w8_tile_is_correct(dtype):
    """Each tile `orinfer.bench.fp8_kernels --sweep` times on uint8 codes computes the same thing."""
    from orinfer.kernels.fp8_gemv import CANDIDATES as GEMV_CANDIDATES
    from orinfer.kernels.fp8_mm import CANDIDATES as MM_CANDIDATES

    w8, perm, w = w8_weight(1536, 2048, 128, True, sym=True)
    for rows, kernel, cfgs in ((1, fp8_gemv, GEMV_CANDIDATES), (8, fp8_mm, MM_CANDIDATES)):
        x = randn(rows, 2048, dtype=dtype)
        for gated in (False, True):
            want = w8a16_ref(x, w, None, gated)
            for cfg in cfgs:
                got = kernel(permuted(x, perm), w8.codes, w8.scales, (1, 128), gated=gated, cfg=cfg, zeros=w8.zeros)
                torch.testing.assert_close(got.double(), want, **tol(dtype, 2), msg=lambda m: f"{cfg} {gated}: {m}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_gpu_w8_kernels_replay_in_cuda_graphs(rows):
    """Captured once (act-order gather included), replayed with new inputs: the results equal eager calls (beyond
    MMA_MAX_ROWS, where cuBLAS may pick another kernel inside a capture, within the tolerance)."""
    w8, perm, _ = w8_weight(4096, 4096, 128, True, sym=True)
    gu, gu_perm, _ = w8_weight(2 * 1536, 4096, 128, True, seed=1)
    x = randn(rows, 4096, dtype=torch.bfloat16)
    w8_ops.w8_linear(permuted(x, perm), w8)                                 # compile outside the capture
    w8_ops.w8_gate_up_silu(permuted(x, gu_perm), gu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w8_ops.w8_linear(permuted(x, perm), w8)
        g = w8_ops.w8_gate_up_silu(permuted(x, gu_perm), gu)
    for seed in range(3):
        x.copy_(randn(rows, 4096, dtype=torch.bfloat16, scale=1.0 + seed))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in ((y, w8_ops.w8_linear(permuted(x, perm), w8)),
                          (g, w8_ops.w8_gate_up_silu(permuted(x, gu_perm), gu))):
            if rows <= w8_ops.MMA_MAX_ROWS:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, **tol(torch.bfloat16))
    assert not splitk.counters(x.device).any()


@gpu
@pytest.mark.gpu
def test_gpu_w8_torch_reference_agrees():
    """The torch backend's W8 linear (dequantise to bf16, cuBLAS) and the kernels agree on a Qwen3-8B shape."""
    w8, perm, w = w8_weight(4096, 4096, 128, True)
    x = randn(4, 4096, dtype=torch.bfloat16)
    check(w8_linear_ref(permuted(x, perm), w8), w8a16_ref(x, w, None, False), torch.bfloat16, 2)
