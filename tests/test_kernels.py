"""Triton kernels against their pure-torch references.

Runs on a GPU, or on the CPU under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 when there is no CUDA
device). References are computed in fp64 on upcast inputs; tolerances are per dtype. Outputs are poisoned: every
torch.empty / empty_like during a kernel call returns NaN-filled memory, so an element a kernel forgets to write
fails the comparison; caches the kernels write into are NaN-filled by the tests themselves.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_checks import (DEVICE, DTYPES, INTERPRET, gpu, poison_allocations, randn, tol,
                           skip_module_without_kernels)
from orinfer.kernels import activation, attention, decode_attention, gemv, norm, rotary

skip_module_without_kernels()


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Fresh seed per test, and NaN-filled (floating) allocations while the test runs."""
    poison_allocations(monkeypatch)
    # Default GEMV configs (the GPU tests check every candidate explicitly; timing them per test shape is slow).
    monkeypatch.setenv("ORINFER_AUTOTUNE", "0")


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert actual.dtype == dtype, (actual.dtype, dtype)
    torch.testing.assert_close(actual.double(), expected.double(), **tol(dtype, scale))


# --- RMSNorm ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (3, 200), (17, 48)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, tokens, hidden, with_residual):
    x, w = randn(tokens, hidden, dtype=dtype), randn(hidden, dtype=dtype, scale=0.2) + 1
    r = randn(tokens, hidden, dtype=dtype) if with_residual else None
    x0, r0 = x.clone(), None if r is None else r.clone()
    got = norm.rms_norm(x, w, 1e-6, r)
    ref = norm.rms_norm_ref(x.double(), w.double(), 1e-6, None if r is None else r.double())
    if with_residual:
        close(got[0], ref[0], dtype)
        close(got[1], ref[1], dtype)
        assert torch.equal(r, r0)
    else:
        close(got, ref, dtype)
    assert torch.equal(x, x0)  # out of place


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_rounds_like_the_reference(dtype):
    """Same-dtype reference, tight: the kernel rounds the residual sum and the normalised value where HF does.
    (bf16 is left out: the interpreter rounds bf16 by truncation; on a GPU it matches as tightly.)"""
    x, r = randn(5, 96, dtype=dtype), randn(5, 96, dtype=dtype)
    w = randn(96, dtype=dtype, scale=0.2) + 1
    got, res = norm.rms_norm(x, w, 1e-6, r)
    ref, ref_res = norm.rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(res, ref_res)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(got, ref, atol=2 * ulp, rtol=2 * ulp)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_strided_view(dtype):
    """The 3-D use: [T, heads, D] views into a wider row (q heads inside a packed qkv output)."""
    qkv = randn(3, 5 * 24 + 16, dtype=dtype)
    q = qkv[:, : 5 * 24].view(3, 5, 24)
    w = randn(24, dtype=dtype, scale=0.2) + 1
    close(norm.rms_norm(q, w, 1e-6), norm.rms_norm_ref(q.double(), w.double(), 1e-6), dtype)


def test_rms_norm_mixed_mode():
    """fp32 activations with a bf16 weight stay fp32."""
    x, r, w = randn(4, 80), randn(4, 80), randn(80, dtype=torch.bfloat16, scale=0.2) + 1
    got, res = norm.rms_norm(x, w, 1e-5, r)
    ref, ref_res = norm.rms_norm_ref(x, w, 1e-5, r)
    close(got, ref, torch.float32)
    close(res, ref_res, torch.float32)


# --- QK-norm + RoPE -----------------------------------------------------------------------------------------------

@pytest.mark.pairwise
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("tokens,hq,hk,head_dim", [(1, 4, 4, 16), (3, 4, 2, 24), (17, 8, 2, 32)])
@pytest.mark.parametrize("partial", [False, True])
def test_qk_norm_rope(dtype, with_norm, tokens, hq, hk, head_dim, partial):
    """Partial rotary (Qwen3.5: a quarter of each head turns, fp32 norm weights 1 + w) and full rotary."""
    rotary_dim = head_dim // 4 if partial else head_dim
    cos_sin = rotary.rope_cos_sin_cache(rotary_dim, 300, 10000.0, device=DEVICE)
    qkv = randn(tokens, (hq + 2 * hk) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)  # strided views, as in the model
    positions = torch.randint(0, 300, (tokens,), device=DEVICE)
    weight_dtype = torch.float32 if partial else dtype
    qw = randn(head_dim, dtype=weight_dtype, scale=0.2) + 1 if with_norm else None
    kw = randn(head_dim, dtype=weight_dtype, scale=0.2) + 1 if with_norm else None
    got_q, got_k = rotary.qk_norm_rope(q, k, positions, cos_sin, head_dim, qw, kw, 1e-6)
    ref_q, ref_k = rotary.qk_norm_rope_ref(q.double(), k.double(), positions, cos_sin.double(), head_dim,
                                           None if qw is None else qw.double(), None if kw is None else kw.double())
    assert got_q.shape == (tokens, hq * head_dim) and got_k.shape == (tokens, hk * head_dim)
    close(got_q, ref_q, dtype, scale=2)
    close(got_k, ref_k, dtype, scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hk,head_dim,rotary_dim", [(1, 4, 2, 16, 16), (5, 4, 2, 24, 24), (5, 4, 2, 32, 8)])
def test_qk_norm_rope_stores_kv(dtype, tokens, hq, hk, head_dim, rotary_dim):
    """With kv_store, the kernel also writes the new k (after norm + RoPE) and v into the paged caches: the same
    caches as the reference op followed by store_kv_ref, padding slots (-1) untouched, and the same q, k outputs."""
    cos_sin = rotary.rope_cos_sin_cache(rotary_dim, 300, 10000.0, device=DEVICE)
    qkv = randn(tokens, (hq + 2 * hk) * head_dim, dtype=dtype)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    positions = torch.randint(0, 300, (tokens,), device=DEVICE)
    qw, kw = randn(head_dim, dtype=dtype, scale=0.2) + 1, randn(head_dim, dtype=dtype, scale=0.2) + 1
    slots = torch.randperm(4 * 8, device=DEVICE)[:tokens]
    slots[tokens // 2] = -1
    caches = [torch.full((4, 8, hk, head_dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    got = rotary.qk_norm_rope(q, k, positions, cos_sin, head_dim, qw, kw, 1e-6,
                              kv_store=rotary.KVStore(v, caches[0], caches[1], slots))
    plain = rotary.qk_norm_rope(q, k, positions, cos_sin, head_dim, qw, kw, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    attention.store_kv_ref(got[1].view(tokens, hk, head_dim), v.reshape(tokens, hk, head_dim), caches[2], caches[3],
                           slots)
    for mine, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(mine.isnan(), ref.isnan()) and torch.equal(mine.nan_to_num(), ref.nan_to_num())
    rotary.qk_norm_rope_ref(q, k, positions, cos_sin, head_dim, qw, kw, 1e-6,
                            kv_store=rotary.KVStore(v, caches[2], caches[3], slots))   # the torch op's store
    ref_k = rotary.qk_norm_rope_ref(q, k, positions, cos_sin, head_dim, qw, kw, 1e-6)[1]
    kept = slots >= 0
    stored = caches[2].view(-1, hk, head_dim)[slots[kept]]
    torch.testing.assert_close(stored.float(), ref_k.view(tokens, hk, head_dim)[kept].float())


def test_qk_norm_rope_rejects_a_mismatched_kv_store():
    cos_sin = rotary.rope_cos_sin_cache(16, 64, 10000.0, device=DEVICE)
    q, k, v = randn(3, 4 * 16), randn(3, 2 * 16), randn(3, 2 * 16)
    cache = torch.zeros(4, 8, 3, 16, device=DEVICE)   # 3 kv heads, k has 2
    with pytest.raises(ValueError, match="kv_store"):
        rotary.qk_norm_rope(q, k, torch.arange(3, device=DEVICE), cos_sin, 16,
                            kv_store=rotary.KVStore(v, cache, cache.clone(), torch.arange(3, device=DEVICE)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_norm_rope_rounds_like_the_reference(dtype):
    cos_sin = rotary.rope_cos_sin_cache(32, 64, 1e6, device=DEVICE)
    q, k = randn(6, 4 * 32, dtype=dtype), randn(6, 2 * 32, dtype=dtype)
    qw, kw = randn(32, dtype=dtype, scale=0.2) + 1, randn(32, dtype=dtype, scale=0.2) + 1
    positions = torch.tensor([0, 1, 5, 17, 63, 2], device=DEVICE)
    got = rotary.qk_norm_rope(q, k, positions, cos_sin, 32, qw, kw)
    ref = rotary.qk_norm_rope_ref(q, k, positions, cos_sin, 32, qw, kw)
    ulp = torch.finfo(dtype).eps
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=4 * ulp, rtol=4 * ulp)


# --- SwiGLU, GEMV, fused gate/up ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (3, 1500), (17, 40)])
def test_silu_and_mul(dtype, tokens, inter):
    gate_up = randn(tokens, 2 * inter, dtype=dtype, scale=2)
    close(activation.silu_and_mul(gate_up), activation.silu_and_mul_ref(gate_up.double()), dtype, scale=2)


# Explicit configs exercise both inner loops with several K steps and a ragged tail at interpreter-friendly sizes.
SMALL_FMA = gemv.GemvConfig(False, 4, 32, 4, 1)
SMALL_DOT = gemv.GemvConfig(True, 16, 32, 4, 1)
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.bfloat16)]  # the last one is mixed mode (fp32 activations, bf16 weights)


# (rows, config): the FMA loop serves one row only.
ROW_CONFIGS = [(1, None), (1, SMALL_FMA), (1, SMALL_DOT), (3, None), (3, SMALL_DOT)]
ROW_CONFIG_IDS = ["b1-default", "b1-fma", "b1-dot", "b3-default", "b3-dot"]


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("rows,cfg", ROW_CONFIGS, ids=ROW_CONFIG_IDS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv(x_dtype, w_dtype, rows, cfg, with_bias):
    n, k = 37, 100  # N not a multiple of BLOCK_N, K not a multiple of BLOCK_K
    x = randn(rows, k, dtype=x_dtype)
    w = randn(n, k, dtype=w_dtype, scale=k ** -0.5)
    b = randn(n, dtype=w_dtype) if with_bias else None
    got = gemv.run_gemv(x, w, b, gated=False, cfg=cfg) if cfg is not None else gemv.gemv(x, w, b)
    ref = gemv.gemv_ref(x.double(), w.double(), None if b is None else b.double())
    close(got, ref, x_dtype, scale=2)


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS)
def test_gemv_even_k_and_leading_dims(x_dtype, w_dtype):
    x = randn(2, 1, 64, dtype=x_dtype)
    w = randn(48, 64, dtype=w_dtype, scale=0.125)
    got = gemv.run_gemv(x, w, None, gated=False, cfg=gemv.GemvConfig(True, 16, 32, 4, 1))  # K % BLOCK_K == 0
    assert got.shape == (2, 1, 48)
    close(got, gemv.gemv_ref(x.double(), w.double()), x_dtype, scale=2)


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("rows,cfg", ROW_CONFIGS, ids=ROW_CONFIG_IDS)
def test_gemv_fp32_out_holds_the_rounded_result(x_dtype, w_dtype, rows, cfg):
    """out_dtype=fp32 (the lm_head's logits) stores exactly the x-dtype result, widened: no extra precision."""
    x = randn(rows, 100, dtype=x_dtype)
    w = randn(37, 100, dtype=w_dtype, scale=0.1)
    if cfg is None:
        wide, narrow = gemv.gemv(x, w, out_dtype=torch.float32), gemv.gemv(x, w)
    else:
        wide = gemv.run_gemv(x, w, None, gated=False, cfg=cfg, out_dtype=torch.float32)
        narrow = gemv.run_gemv(x, w, None, gated=False, cfg=cfg)
    assert wide.dtype == torch.float32 and torch.equal(wide, narrow.float())


def test_gemv_falls_back_beyond_max_rows():
    x, w = randn(gemv.MAX_ROWS + 1, 32), randn(20, 32)
    close(gemv.gemv(x, w), gemv.gemv_ref(x.double(), w.double()), torch.float32)


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("rows,cfg", ROW_CONFIGS, ids=ROW_CONFIG_IDS)
def test_fused_gate_up_silu(x_dtype, w_dtype, rows, cfg):
    hidden, inter = 72, 45
    x = randn(rows, hidden, dtype=x_dtype, scale=2)
    w = randn(2 * inter, hidden, dtype=w_dtype, scale=hidden ** -0.5)
    if cfg is None:
        got = activation.fused_gate_up_silu(x, w)
    else:
        got = gemv.run_gemv(x, w, None, gated=True, cfg=cfg)
    assert got.shape == (rows, inter)
    close(got, activation.fused_gate_up_silu_ref(x.double(), w.double()), x_dtype, scale=2)


def test_fused_gate_up_silu_large_batch_falls_back():
    x, w = randn(20, 32), randn(2 * 24, 32, scale=0.2)
    close(activation.fused_gate_up_silu(x, w), activation.fused_gate_up_silu_ref(x.double(), w.double()),
          torch.float32)


# --- KV store and attention ---------------------------------------------------------------------------------------

def make_paged(ctx_lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
               extra_blocks: int = 3):
    """Caches (NaN outside the sequences' slots) filled through store_kv, with scattered block tables."""
    blocks = [math.ceil(n / block_size) for n in ctx_lens]
    num_blocks = sum(blocks) + extra_blocks
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    perm = torch.randperm(num_blocks)
    width = max(blocks) + 1
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int32)
    slots, used = [], 0
    for i, (n, nb) in enumerate(zip(ctx_lens, blocks)):
        tables[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        pos = torch.arange(n)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    total = sum(ctx_lens)
    k, v = randn(total, kv_heads, head_dim, dtype=dtype), randn(total, kv_heads, head_dim, dtype=dtype)
    attention.store_kv(k, v, k_cache, v_cache, torch.cat(slots).to(DEVICE))
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, tables.to(DEVICE), lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 16), (2, 24), (4, 64)])
def test_store_kv(dtype, kv_heads, head_dim):
    tokens, block_size, num_blocks = 11, 8, 4
    packed = randn(tokens, 3 * kv_heads * head_dim, dtype=dtype)  # k, v as strided views of a packed row
    k = packed[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = packed[:, kv_heads * head_dim: 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[[2, 7]] = -1  # padding rows are skipped
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc, vc = (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    kr, vr = kc.clone(), vc.clone()
    attention.store_kv(k, v, kc, vc, slots)
    attention.store_kv_ref(k, v, kr, vr, slots)
    assert torch.equal(kc.isnan(), kr.isnan()) and torch.equal(vc.isnan(), vr.isnan())
    assert torch.equal(kc.nan_to_num(), kr.nan_to_num()) and torch.equal(vc.nan_to_num(), vr.nan_to_num())


def test_store_kv_converts_to_cache_dtype():
    k, v = randn(4, 2, 16), randn(4, 2, 16)
    kc = torch.full((2, 8, 2, 16), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    vc = kc.clone()
    slots = torch.tensor([0, 9, 3, -1], device=DEVICE, dtype=torch.int32)
    attention.store_kv(k, v, kc, vc, slots)
    stored, expected = kc.view(-1, 2, 16)[[0, 9, 3]].float(), k[:3].to(torch.bfloat16).float()
    if INTERPRET:  # the interpreter converts fp32 -> bf16 by truncation
        torch.testing.assert_close(stored, expected, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(stored, expected)
    assert kc.view(-1, 2, 16)[[1, 2, 4]].isnan().all()


DECODE_CASES = [  # (context lengths, kv heads, group, head_dim, block_size, num_splits)
    ([1, 8, 9, 100], 2, 1, 32, 8, None),
    ([16, 17, 130], 1, 4, 24, 16, 3),
    ([1, 64, 65, 200], 2, 2, 16, 8, 7),
    ([33, 5], 2, 4, 64, 16, 1),
    ([150], 1, 8, 32, 16, 4),
]


# Each case runs one dtype in the default tier (a different one case by case), every other dtype in the slow tier.
DECODE_PARAMS = [pytest.param(case, dtype, id=f"ctx{case[0]}-hk{case[1]}-g{case[2]}-d{case[3]}-bs{case[4]}-s{case[5]}"
                              f"-{str(dtype).removeprefix('torch.')}",
                              marks=() if i % len(DTYPES) == j else pytest.mark.slow)
                 for i, case in enumerate(DECODE_CASES) for j, dtype in enumerate(DTYPES)]


@pytest.mark.parametrize("case, dtype", DECODE_PARAMS)
def test_paged_decode_attention(case, dtype):
    ctx_lens, kv_heads, group, head_dim, block_size, splits = case
    k_cache, v_cache, tables, lens = make_paged(ctx_lens, kv_heads, head_dim, block_size, dtype)
    q = randn(len(ctx_lens), kv_heads * group, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    got = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits)
    qsl = torch.arange(len(ctx_lens) + 1, device=DEVICE)
    ref = attention.paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, lens, qsl, scale)
    close(got, ref, dtype)
    # The public op dispatches decode batches to the same kernel.
    close(decode_attention.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale), ref, dtype)


def test_paged_decode_attention_empty_context_writes_zeros():
    k_cache, v_cache, tables, lens = make_paged([5, 3], 1, 16, 8, torch.float32)
    lens[1] = 0  # a padded batch slot
    q = randn(2, 2, 16)
    for splits in (1, 4):
        got = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, num_splits=splits)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        assert not got[0].isnan().any()


def test_paged_attention_multi_token_falls_back_to_reference():
    k_cache, v_cache, tables, lens = make_paged([6, 9], 1, 16, 8, torch.float32)
    q = randn(5, 2, 16)
    qsl = torch.tensor([0, 2, 5], device=DEVICE)
    got = decode_attention.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.25)
    ref = attention.paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, lens, qsl, 0.25)
    close(got, ref, torch.float32)


VARLEN_CASES = [  # (segment lengths, kv heads, group, head_dim)
    ([1], 1, 1, 16),
    ([17, 3, 40], 2, 2, 24),
    ([33, 1, 16], 1, 4, 32),
    ([5, 64], 2, 1, 64),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", VARLEN_CASES, ids=[f"len{c[0]}-hk{c[1]}-g{c[2]}-d{c[3]}" for c in VARLEN_CASES])
@pytest.mark.parametrize("give_max", [False, True])
def test_varlen_attention(dtype, case, give_max):
    lengths, kv_heads, group, head_dim = case
    total = sum(lengths)
    starts = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    packed = randn(total, (kv_heads * group + 2 * kv_heads) * head_dim, dtype=dtype)
    q_size, kv_size = kv_heads * group * head_dim, kv_heads * head_dim
    q, k, v = (t.view(total, -1, head_dim) for t in packed.split([q_size, kv_size, kv_size], dim=-1))
    scale = head_dim ** -0.5
    kwargs = {"max_seqlen": max(lengths)} if give_max else {}
    got = attention.varlen_attention(q, k, v, starts, scale, **kwargs)
    ref = attention.varlen_causal_attention_ref(q.double(), k.double(), v.double(), starts, scale)
    close(got, ref, dtype)


# --- larger shapes: GPU only --------------------------------------------------------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rms_norm_and_rope_qwen3_shapes(dtype):
    x, r, w = randn(64, 4096, dtype=dtype), randn(64, 4096, dtype=dtype), randn(4096, dtype=dtype, scale=0.2) + 1
    got, res = norm.rms_norm(x, w, 1e-6, r)
    ref, ref_res = norm.rms_norm_ref(x.double(), w.double(), 1e-6, r.double())
    close(got, ref, dtype)
    close(res, ref_res, dtype)
    cos_sin = rotary.rope_cos_sin_cache(128, 40960, 1e6, device=DEVICE)
    qkv = randn(33, 48 * 128, dtype=dtype)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    pos = torch.randint(0, 40960, (33,), device=DEVICE)
    qw, kw = randn(128, dtype=dtype, scale=0.2) + 1, randn(128, dtype=dtype, scale=0.2) + 1
    got = rotary.qk_norm_rope(q, k, pos, cos_sin, 128, qw, kw)
    ref = rotary.qk_norm_rope_ref(q.double(), k.double(), pos, cos_sin.double(), 128, qw.double(), kw.double())
    for g, e in zip(got, ref):
        close(g, e, dtype, scale=2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_gpu_gemv_and_fused_ffn_qwen3_shapes(x_dtype, w_dtype, rows):
    x = randn(rows, 4096, dtype=x_dtype)
    w = randn(6144, 4096, dtype=w_dtype, scale=4096 ** -0.5)
    # Every candidate the tuner may pick for this dtype must be correct (cuBLAS aside).
    configs = [c for c in gemv.tuning_plan(rows, False, x_dtype, w_dtype)[0] if c != gemv.CUBLAS]
    ref = gemv.gemv_ref(x.double(), w.double())
    close(gemv.gemv(x, w), ref, x_dtype, scale=2)
    for cfg in configs:
        close(gemv.run_gemv(x, w, None, gated=False, cfg=cfg), ref, x_dtype, scale=2)
    gate_up = randn(2 * 3072, 4096, dtype=w_dtype, scale=4096 ** -0.5)
    ref = activation.fused_gate_up_silu_ref(x.double(), gate_up.double())
    close(activation.fused_gate_up_silu(x, gate_up), ref, x_dtype, scale=2)
    for cfg in [c for c in gemv.tuning_plan(rows, True, x_dtype, w_dtype)[0] if c != gemv.CUBLAS]:
        close(gemv.run_gemv(x, gate_up, None, gated=True, cfg=cfg), ref, x_dtype, scale=2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 9])
def test_gpu_lm_head_returns_fp32_logits_of_the_16_bit_linear(rows):
    """The triton backend's lm_head (the GEMV storing fp32 itself up to 8 rows, the linear then a widening beyond):
    fp32 logits whose values are 16-bit ones, within a rounding of the fp64 product."""
    from orinfer.layers.ops import lm_head_ref
    from orinfer.layers.triton_ops import triton_lm_head

    x = randn(rows, 1024, dtype=torch.bfloat16)
    w = randn(3000, 1024, dtype=torch.bfloat16, scale=1024 ** -0.5)
    got = triton_lm_head(x, w)
    assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())
    torch.testing.assert_close(got.double(), lm_head_ref(x.double(), w.double()).double(), **tol(torch.bfloat16, 2))


@gpu
@pytest.mark.gpu
def test_gpu_tuner_times_candidates_and_caches_the_choice(monkeypatch):
    monkeypatch.setenv("ORINFER_AUTOTUNE", "1")
    # fp32 and mixed inputs go through the tuner; 16-bit ones use the configs measured on the H200.
    x, w = randn(4, 4096, dtype=torch.float32), randn(4096, 4096, dtype=torch.float32, scale=4096 ** -0.5)
    close(gemv.gemv(x, w), gemv.gemv_ref(x.double(), w.double()), torch.float32, scale=2)
    key = (4096, 4096, 4, False, False, torch.float32, torch.float32, None, str(x.device))  # None: out_dtype
    assert key in gemv.TUNER.cache
    one, w16 = randn(1, 4096, dtype=torch.bfloat16), w.to(torch.bfloat16)
    close(gemv.gemv(one, w16), gemv.gemv_ref(one.double(), w16.double()), torch.bfloat16, scale=2)
    assert (4096, 4096, 1, False, False, torch.bfloat16, torch.bfloat16, None, str(x.device)) not in gemv.TUNER.cache
    close(gemv.gemv(x, w), gemv.gemv_ref(x.double(), w.double()), torch.float32, scale=2)  # the cached choice


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 72])
def test_gpu_paged_decode_long_context(dtype, block_size, head_dim):
    ctx = [4096, 1, 777, 2048 + 3]
    k_cache, v_cache, tables, lens = make_paged(ctx, 8, head_dim, block_size, dtype)
    q = randn(len(ctx), 32, head_dim, dtype=dtype)
    qsl = torch.arange(len(ctx) + 1, device=DEVICE)
    ref = attention.paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, lens, qsl,
                                        head_dim ** -0.5)
    for splits in (None, 1, 16, 64):
        got = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, splits)
        close(got, ref, dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 72])
def test_gpu_varlen_attention_long(dtype, head_dim):
    lengths = [1000, 37, 513, 1]
    total = sum(lengths)
    starts = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q, k, v = randn(total, 16, head_dim, dtype=dtype), randn(total, 4, head_dim, dtype=dtype), \
        randn(total, 4, head_dim, dtype=dtype)
    ref = attention.varlen_causal_attention_ref(q.double(), k.double(), v.double(), starts, head_dim ** -0.5)
    close(attention.varlen_attention(q, k, v, starts, head_dim ** -0.5), ref, dtype)
