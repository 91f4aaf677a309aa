"""The fp8 KV cache's kernels against torch references that dequantize: the quantizing stores (`store_kv`, the store
fused into `qk_norm_rope`) bit for bit, and the decode, extend and verify attention kernels reading fp8 blocks (odd
lengths, block offsets, shuffled tables, GQA, splits, padded graph batches). CPU interpreter or GPU."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, poison_allocations, randn, shuffled_block_tables, skip_module_without_kernels, tol
from orinfer.kernels import attention, decode_attention, rotary
from orinfer.kernels.extend_attention import extend_attention
from orinfer.kernels.verify_attention import verify_attention
from orinfer.kernels.kv_fp8 import (FP8_MAX, KV_FP8_DTYPE, dequantize_kv_ref, fake_quantize_kv, kv_scale_from_amax,
                                    quantize_kv_ref)

skip_module_without_kernels()

FP8_NAN = 0x7F  # an e4m3fn NaN byte: what unwritten or never-read cache slots hold in these tests


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    poison_allocations(monkeypatch)


def nan_cache(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, FP8_NAN, dtype=torch.uint8, device=DEVICE).view(KV_FP8_DTYPE)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- the format ------------------------------------------------------------------------------------------------------

def test_scales_are_powers_of_two_with_headroom():
    amax = torch.tensor([0.0, 1e-3, 1.0, 3.0, 448.0, 5000.0])
    s = kv_scale_from_amax(amax, headroom=2.0)
    mantissa, _ = torch.frexp(s)
    assert torch.all(mantissa == 0.5)                         # powers of two
    assert torch.all(s * FP8_MAX >= 2.0 * amax)                # the headroom fits below saturation
    assert torch.all((s / 2) * FP8_MAX < 2.0 * amax.clamp_min(2.0 ** -20 * FP8_MAX / 2))  # and is the smallest such
    assert s[0] == 2.0 ** -20


def test_quantize_rounds_to_nearest_even_and_saturates():
    scale = torch.tensor([0.5, 4.0])
    x = torch.tensor([[[1.0, -3.3, 1000.0, -1e9, 0.0, 17.0]], [[1.0, -3.3, 1000.0, -1e9, 0.0, 17.0]]])
    x = x.view(2, 1, 6).transpose(0, 1)                        # [1 token, 2 heads, 6]
    q = quantize_kv_ref(x, scale)
    assert q.dtype == KV_FP8_DTYPE and not q.float().isnan().any()
    back = dequantize_kv_ref(q, scale)
    assert back[0, 0, 2] == FP8_MAX * 0.5 and back[0, 0, 3] == -FP8_MAX * 0.5   # saturated, not NaN
    # In range: x / s rounded to e4m3 (torch's cast is round-to-nearest-even), times s exactly.
    in_range = (x[0, 1] / 4.0).abs() <= FP8_MAX  # (torch's cast of larger values is NaN in some versions)
    want = (x[0, 1][in_range] / 4.0).to(KV_FP8_DTYPE).float() * 4.0
    assert torch.equal(back[0, 1][in_range], want)
    # e4m3 keeps 3 mantissa bits: the relative error is at most 2^-4 for normal values.
    normal = x.abs() / scale[:, None] >= 2.0 ** -6
    rel = ((back - x).abs() / x.abs().clamp_min(1e-30))[normal & (x.abs() / scale[:, None] <= FP8_MAX)]
    assert rel.max() <= 2.0 ** -4


# --- the quantizing stores -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 16), (3, 24)])
def test_store_kv_quantizes_like_the_reference(dtype, kv_heads, head_dim):
    """The kernel's fp8 bytes equal `store_kv_ref`'s (x / scale, saturated, nearest-even), padding slots untouched;
    k and v are strided views, values include some beyond the saturation point."""
    tokens, block_size, num_blocks = 11, 8, 3
    packed = randn(tokens, 3 * kv_heads * head_dim, dtype=dtype, scale=3.0)
    packed[0, :4] = 1e4  # saturates
    k = packed[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = packed[:, kv_heads * head_dim: 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    k_scale = kv_scale_from_amax(torch.linspace(0.5, 8.0, kv_heads)).to(DEVICE)
    v_scale = kv_scale_from_amax(torch.linspace(2.0, 0.1, kv_heads)).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[[2, 7]] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc, vc, kr, vr = (nan_cache(shape) for _ in range(4))
    attention.store_kv(k, v, kc, vc, slots, k_scale=k_scale, v_scale=v_scale)
    attention.store_kv_ref(k, v, kr, vr, slots, k_scale=k_scale, v_scale=v_scale)
    assert same_bytes(kc, kr) and same_bytes(vc, vr)
    written = kc.view(-1, kv_heads, head_dim)[slots[slots >= 0]].float()
    assert not written.isnan().any() and written.abs().max() == FP8_MAX   # the 1e4 values saturated
    assert (kc.view(torch.uint8) == FP8_NAN).sum() == (num_blocks * block_size - tokens + 2) * kv_heads * head_dim


def test_store_kv_wants_scales_for_an_fp8_cache():
    k = randn(2, 1, 16)
    kc, vc = nan_cache((1, 4, 1, 16)), nan_cache((1, 4, 1, 16))
    slots = torch.tensor([0, 1], device=DEVICE)
    for op in (attention.store_kv, attention.store_kv_ref):
        with pytest.raises(ValueError, match="k_scale"):
            op(k, k, kc, vc, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(24, 24), (32, 8)])
def test_qk_norm_rope_store_quantizes_its_own_k(dtype, head_dim, rotary_dim):
    """The RoPE kernel's fused store (full and partial rotary) writes exactly quantize(k_out) and quantize(v)."""
    tokens, hq, hk = 5, 4, 2
    cos_sin = rotary.rope_cos_sin_cache(rotary_dim, 300, 10000.0, device=DEVICE)
    qkv = randn(tokens, (hq + 2 * hk) * head_dim, dtype=dtype)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    positions = torch.randint(0, 300, (tokens,), device=DEVICE)
    qw, kw = randn(head_dim, dtype=dtype, scale=0.2) + 1, randn(head_dim, dtype=dtype, scale=0.2) + 1
    k_scale = torch.tensor([2.0 ** -5, 2.0 ** -3], device=DEVICE)
    v_scale = torch.tensor([2.0 ** -4, 2.0 ** -6], device=DEVICE)
    slots = torch.randperm(4 * 8, device=DEVICE)[:tokens]
    slots[tokens // 2] = -1
    kc, vc = nan_cache((4, 8, hk, head_dim)), nan_cache((4, 8, hk, head_dim))
    _, k_out = rotary.qk_norm_rope(q, k, positions, cos_sin, head_dim, qw, kw, 1e-6,
                                   kv_store=rotary.KVStore(v, kc, vc, slots, k_scale, v_scale))
    kept = slots >= 0
    for cache, x, s in ((kc, k_out, k_scale), (vc, v, v_scale)):
        stored = cache.view(-1, hk, head_dim)[slots[kept]]
        assert same_bytes(stored, quantize_kv_ref(x.reshape(tokens, hk, head_dim)[kept], s))
    assert (kc.view(torch.uint8) == FP8_NAN).sum() == (32 - tokens + 1) * hk * head_dim


# --- attention over fp8 blocks ----------------------------------------------------------------------------------------

def fp8_batch(queries: list[int], contexts: list[int], block_size: int, kv_heads: int, head_dim: int, seed: int):
    """Shuffled fp8 caches holding each sequence's context (spare blocks: NaN bytes, never read), per-head scales
    for K/V of different magnitudes per head, and query_start_loc."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks, spare = shuffled_block_tables(contexts, block_size, gen)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    head_gain = torch.logspace(-1, 1, kv_heads)[:, None]             # 0.1 .. 10: per-head scales matter
    k = torch.randn(shape, generator=gen) * head_gain
    v = torch.randn(shape, generator=gen) * head_gain.flip(0)
    k_scale = kv_scale_from_amax(k.abs().amax(dim=(0, 1, 3)))
    v_scale = kv_scale_from_amax(v.abs().amax(dim=(0, 1, 3)))
    k_cache, v_cache = quantize_kv_ref(k, k_scale), quantize_kv_ref(v, v_scale)
    for cache in (k_cache, v_cache):
        cache.view(torch.uint8)[spare] = FP8_NAN
    starts = torch.tensor([0] + queries, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return dict(k_cache=k_cache.to(DEVICE), v_cache=v_cache.to(DEVICE), block_tables=tables.to(DEVICE),
                context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
                query_start_loc=starts.to(DEVICE), k_scale=k_scale.to(DEVICE), v_scale=v_scale.to(DEVICE))


def dequantized_reference(q: torch.Tensor, b: dict, scale: float) -> torch.Tensor:
    """fp64 attention over the dequantized caches (the 16/32-bit reference, no fp8 code path)."""
    k = dequantize_kv_ref(b["k_cache"], b["k_scale"]).double()
    v = dequantize_kv_ref(b["v_cache"], b["v_scale"]).double()
    return attention.paged_attention_ref(q.double(), k, v, b["block_tables"], b["context_lens"],
                                         b["query_start_loc"], scale)


def test_reference_dequantizes_like_a_16_bit_cache():
    b = fp8_batch([3, 1], [19, 7], 4, 2, 16, seed=1)
    q = randn(4, 4, 16)
    got = attention.paged_attention_ref(q, b["k_cache"], b["v_cache"], b["block_tables"], b["context_lens"],
                                        b["query_start_loc"], 0.25, k_scale=b["k_scale"], v_scale=b["v_scale"])
    torch.testing.assert_close(got.double(), dequantized_reference(q, b, 0.25), **tol(torch.float32))


DECODE_CASES = [  # (context lengths, kv heads, group, head_dim, block_size, num_splits)
    ([1, 9, 100], 2, 1, 32, 8, None),
    ([16, 17, 130], 1, 4, 24, 16, 3),
    ([5, 65], 2, 3, 16, 4, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"ctx{c[0]}-hk{c[1]}-g{c[2]}-d{c[3]}-bs{c[4]}-s{c[5]}"
                                                    for c in DECODE_CASES])
def test_decode_attention_reads_fp8(dtype, case):
    ctx_lens, kv_heads, group, head_dim, block_size, splits = case
    b = fp8_batch([1] * len(ctx_lens), ctx_lens, block_size, kv_heads, head_dim, seed=2)
    q = randn(len(ctx_lens), kv_heads * group, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    got = decode_attention.paged_decode_attention(q, b["k_cache"], b["v_cache"], b["block_tables"],
                                                  b["context_lens"], scale, num_splits=splits,
                                                  k_scale=b["k_scale"], v_scale=b["v_scale"])
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), dequantized_reference(q, b, scale), **tol(dtype))


@pytest.mark.parametrize("queries, contexts, block_size, kv_heads, group, dtype", [
    ([7], [7], 16, 2, 2, torch.float32),                        # a whole prompt read back from the cache
    ([1, 12, 9, 3], [50, 12, 30, 19], 16, 2, 2, torch.float32),  # decode, prompt, chunk inside a block, chunk
    ([3, 11], [29, 11], 4, 1, 6, torch.bfloat16),                # small blocks, one KV head for six q heads
])
def test_extend_attention_reads_fp8(queries, contexts, block_size, kv_heads, group, dtype):
    head_dim = 24
    b = fp8_batch(queries, contexts, block_size, kv_heads, head_dim, seed=3)
    q = randn(sum(queries), kv_heads * group, head_dim, dtype=dtype)
    got = extend_attention(q, b["k_cache"], b["v_cache"], b["block_tables"], b["context_lens"],
                           b["query_start_loc"], 0.3, max_query_len=max(queries), k_scale=b["k_scale"],
                           v_scale=b["v_scale"])
    torch.testing.assert_close(got.double(), dequantized_reference(q, b, 0.3), **tol(dtype))


def test_extend_attention_fixed_launch_reads_fp8():
    """The mixed-step CUDA-graph form (padding rows and empty padding sequences) over fp8 blocks."""
    queries, contexts, pad_rows, pad_seqs = [1, 12, 3], [50, 12, 19], 9, 4
    b = fp8_batch(queries, contexts, 8, 2, 16, seed=4)
    total = sum(queries)
    q = randn(total + pad_rows, 4, 16)
    zeros = torch.zeros(pad_seqs, dtype=torch.int32, device=DEVICE)
    got = extend_attention(q, b["k_cache"], b["v_cache"],
                           torch.cat([b["block_tables"], zeros[:, None].expand(-1, b["block_tables"].shape[1])]),
                           torch.cat([b["context_lens"], zeros]),
                           torch.cat([b["query_start_loc"], b["query_start_loc"][-1:].expand(pad_seqs)]), 0.25,
                           fixed_launch=True, k_scale=b["k_scale"], v_scale=b["v_scale"])
    torch.testing.assert_close(got[:total].double(), dequantized_reference(q[:total], b, 0.25),
                               **tol(torch.float32))


@pytest.mark.parametrize("queries, contexts, block_size, kv_heads, group, dtype", [
    ([5], [37], 16, 2, 2, torch.float32),                       # a verify step of 1 + 4 rows
    ([1, 4, 0, 3], [50, 12, 0, 19], 8, 2, 3, torch.float32),    # verify steps beside an empty sequence
    ([4, 2], [29, 70], 16, 1, 6, torch.bfloat16),               # one KV head for six q heads, fp16 dots
])
def test_verify_attention_reads_fp8(queries, contexts, block_size, kv_heads, group, dtype):
    """Padding rows after the batch (as a graph bucket pads it) stay unwritten; contexts split over many programs."""
    head_dim, pad_rows = 24, 3
    b = fp8_batch(queries, [max(c, 1) for c in contexts], block_size, kv_heads, head_dim, seed=5)
    b["context_lens"] = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    total = sum(queries)
    q = randn(total + pad_rows, kv_heads * group, head_dim, dtype=dtype)
    got = verify_attention(q, b["k_cache"], b["v_cache"], b["block_tables"], b["context_lens"],
                           b["query_start_loc"], 0.3, max_query_len=total + pad_rows, fixed_launch=True,
                           k_scale=b["k_scale"], v_scale=b["v_scale"], num_programs=8, min_split_tiles=1)
    torch.testing.assert_close(got[:total].double(), dequantized_reference(q[:total], b, 0.3), **tol(dtype))
    assert got[total:].isnan().all()


def test_fake_quantize_matches_the_cache_round_trip():
    x = randn(9, 2, 16, scale=5.0)
    s = kv_scale_from_amax(x.abs().amax(dim=(0, 2)).cpu()).to(DEVICE)
    assert torch.equal(fake_quantize_kv(x, s), dequantize_kv_ref(quantize_kv_ref(x, s), s))
