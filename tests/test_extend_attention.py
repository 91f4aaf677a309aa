"""The paged extend-attention kernel against `paged_attention_ref`: batches that mix decode rows, prompt chunks after
cached blocks and whole prompts, at odd lengths and block offsets, shuffled block tables, GQA, every dtype; on the CPU
interpreter and the GPU."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, poison_allocations, shuffled_block_tables, skip_module_without_kernels, tol
from orinfer.kernels.attention import paged_attention_ref
from orinfer.kernels.decode_attention import paged_attention, paged_decode_attention
from orinfer.kernels.extend_attention import extend_attention
from orinfer.kernels.verify_attention import verify_attention

skip_module_without_kernels()


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    poison_allocations(monkeypatch)  # an output row the kernel forgets to write is NaN, not leftover memory


def make_batch(queries: list[int], contexts: list[int], block_size: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, seed: int = 0):
    """Random caches holding every sequence's `contexts[b]` tokens in shuffled blocks (the new ones included, as the
    KV store writes them before attention), and `queries[b]` new query rows per sequence."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks, _ = shuffled_block_tables(contexts, block_size, gen, spare=3)  # spare blocks: garbage
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    starts = torch.tensor([0] + queries, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return (k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
            torch.tensor(contexts, dtype=torch.int32, device=DEVICE), starts.to(DEVICE))


def check(queries: list[int], contexts: list[int], *, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
          block_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
    k_cache, v_cache, tables, lens, starts = make_batch(queries, contexts, block_size, kv_heads, head_dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(queries), heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    got = extend_attention(q, k_cache, v_cache, tables, lens, starts, scale, max_query_len=max(queries))
    want = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, lens, starts, scale)
    torch.testing.assert_close(got.double(), want, **tol(dtype))


@pytest.mark.parametrize("queries, contexts", [
    ([1], [1]),                                  # a one-token prompt
    ([7], [7]),                                  # a whole prompt, shorter than a block
    ([33], [33]),                                # a whole prompt across three blocks
    ([5], [21]),                                 # a chunk after 16 cached tokens (a block boundary)
    ([9], [30]),                                 # a chunk starting inside a block
    ([1, 1, 1], [1, 17, 40]),                    # decode rows
    ([1, 12, 40, 3], [50, 12, 57, 19]),          # a mixed step: decode, prompt, chunk after a cached prefix
    ([17, 16, 15], [17, 32, 47]),                # chunk ends at, before and after block boundaries
])
def test_matches_the_reference(queries, contexts):
    check(queries, contexts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit(dtype):
    check([1, 20, 6], [45, 20, 38], dtype=dtype, seed=3)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (2, 2, 64, 4),      # MHA, small blocks: many table lookups per tile
    (8, 2, 24, 16),     # head_dim not a power of two
    (6, 1, 128, 32),    # one KV head for six query heads
])
def test_shapes(heads, kv_heads, head_dim, block_size):
    check([3, 11], [29, 11], heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, seed=7)


@pytest.mark.slow
def test_long_context_crosses_many_tiles():
    check([24, 1], [200, 131], seed=11)


def test_max_query_len_read_from_the_batch_when_not_given():
    k_cache, v_cache, tables, lens, starts = make_batch([2, 5], [9, 5], 4, 1, 16, torch.float32)
    q = torch.randn(7, 2, 16).to(DEVICE)
    got = extend_attention(q, k_cache, v_cache, tables, lens, starts, 0.25)
    torch.testing.assert_close(got, paged_attention_ref(q, k_cache, v_cache, tables, lens, starts, 0.25))


@pytest.mark.parametrize("attention", [extend_attention, verify_attention])
def test_bad_shapes_are_named(attention):
    """Both kernels over a cached context check their inputs alike (`extend_attention.paged_inputs`) and name
    themselves."""
    k_cache, v_cache, tables, lens, starts = make_batch([2], [9], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=attention.__name__):
        attention(torch.randn(2, 3, 16).to(DEVICE), k_cache, v_cache, tables, lens, starts, 0.25)  # 3 % 2
    with pytest.raises(ValueError, match=attention.__name__):
        attention(torch.randn(2, 2, 16).to(DEVICE), k_cache, v_cache, tables, lens, starts[:1], 0.25)


@pytest.mark.parametrize("queries, contexts, pad_rows, pad_seqs", [
    ([1, 1, 1], [1, 17, 40], 13, 5),             # decode rows, as a graph bucket of 16 rows pads them
    pytest.param([1, 12, 40, 3], [50, 12, 57, 19], 8, 60,   # a mixed step, many empty sequences after it
                 marks=pytest.mark.slow),
    ([37], [70], 0, 0),                          # no padding: the bound is tight
    ([2, 33, 1], [9, 33, 80], 20, 1),
])
def test_fixed_launch_covers_padded_batches(queries, contexts, pad_rows, pad_seqs):
    """The CUDA-graph form: the grid comes from T and B alone; padding rows and empty sequences change nothing."""
    k_cache, v_cache, tables, lens, starts = make_batch(queries, contexts, 16, 2, 32, torch.float32, seed=5)
    total = sum(queries)
    q = torch.randn(total + pad_rows, 4, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    padded_starts = torch.cat([starts, starts[-1:].expand(pad_seqs)])
    padded_lens = torch.cat([lens, torch.zeros(pad_seqs, dtype=torch.int32, device=DEVICE)])
    padded_tables = torch.cat([tables, torch.zeros(pad_seqs, tables.shape[1], dtype=torch.int32, device=DEVICE)])
    got = extend_attention(q, k_cache, v_cache, padded_tables, padded_lens, padded_starts, 0.2, fixed_launch=True)
    want = paged_attention_ref(q[:total].double(), k_cache.double(), v_cache.double(), tables, lens, starts, 0.2)
    torch.testing.assert_close(got[:total].double(), want, **tol(torch.float32))


MIXED = [
    pytest.param([1, 40, 1, 16, 17], [30, 40, 9, 50, 70],  # decode rows, a whole prompt, chunks at the bound and past
                 marks=pytest.mark.slow),
    ([1, 1, 24, 3], [64, 5, 33, 7]),             # prompt chunks beside two decode rows
]


@pytest.mark.parametrize("queries, contexts", MIXED)
@pytest.mark.parametrize("fixed", [False, True])
def test_mixed_steps_split_between_the_two_kernels(queries, contexts, fixed):
    """`paged_attention` on a mixed step: decode rows through the flash-decoding kernel (varlen form), the chunks
    (of 16 rows, past 16, and few) through the extend kernel, into one output (an unwritten row is NaN); in the
    CUDA-graph form too, with padding rows and empty sequences."""
    k_cache, v_cache, tables, lens, starts = make_batch(queries, contexts, 16, 2, 32, torch.bfloat16, seed=8)
    total, pad_rows, pad_seqs = sum(queries), (7 if fixed else 0), (3 if fixed else 0)
    q = torch.randn(total + pad_rows, 4, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(DEVICE)
    padded_starts = torch.cat([starts, starts[-1:].expand(pad_seqs)])
    padded_lens = torch.cat([lens, torch.zeros(pad_seqs, dtype=torch.int32, device=DEVICE)])
    padded_tables = torch.cat([tables, torch.zeros(pad_seqs, tables.shape[1], dtype=torch.int32, device=DEVICE)])
    got = paged_attention(q, k_cache, v_cache, padded_tables, padded_lens, padded_starts, 0.2,
                          max_query_len=total + pad_rows if fixed else max(queries), fixed_launch=fixed)
    want = paged_attention_ref(q[:total].double(), k_cache.double(), v_cache.double(), tables, lens, starts, 0.2)
    torch.testing.assert_close(got[:total].double(), want, **tol(torch.bfloat16))


@pytest.mark.parametrize("fixed", [pytest.param(False, marks=pytest.mark.slow), True])
def test_each_kernel_leaves_the_other_kernels_rows_alone(fixed):
    queries, contexts = [1, 20, 3, 1], [33, 20, 40, 9]
    k_cache, v_cache, tables, lens, starts = make_batch(queries, contexts, 16, 2, 32, torch.float32, seed=10)
    q = torch.randn(sum(queries), 4, 32, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    want = paged_attention_ref(q, k_cache, v_cache, tables, lens, starts, 0.2)
    long_rows = torch.zeros(sum(queries), dtype=torch.bool, device=DEVICE)
    long_rows[1:24] = True
    out = torch.full_like(q, 7.0)
    extend_attention(q, k_cache, v_cache, tables, lens, starts, 0.2, max_query_len=max(queries), fixed_launch=fixed,
                     rows_above=1, out=out)
    torch.testing.assert_close(out[long_rows], want[long_rows], **tol(torch.float32))
    assert (out[~long_rows] == 7.0).all()
    # the flash-decoding kernel's varlen form, which paged_attention gives a mixed step's decode rows, split or not
    for num_splits in (1, 3):
        out = torch.full_like(q, 7.0)
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2, num_splits, query_start_loc=starts, out=out)
        torch.testing.assert_close(out[~long_rows], want[~long_rows], **tol(torch.float32))
        assert (out[long_rows] == 7.0).all(), num_splits
