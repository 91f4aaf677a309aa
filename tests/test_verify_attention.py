"""The split-KV verify-attention kernel against `paged_attention_ref`: speculative verify steps (1..16 rows per
sequence) over short and split contexts, rows beyond a query block, GQA groups 1..8 (6 included), head_dim 64/128/256
and odd, block sizes 4/16/32, every dtype, padded CUDA-graph batches (empty sequences, padding rows left unwritten);
and paged_attention's dispatch. On the CPU interpreter and the GPU; `gpu` tests at Qwen3.5-27B's and Qwen3-8B's heads,
inside a captured CUDA graph replayed with other lengths. (fp8 caches: tests/test_kv_fp8_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, gpu, poison_allocations, shuffled_block_tables, skip_module_without_kernels, tol
from orinfer.kernels import decode_attention
from orinfer.kernels.attention import paged_attention_ref
from orinfer.kernels.verify_attention import verify_attention

skip_module_without_kernels()


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    poison_allocations(monkeypatch)  # a row (or partial) the kernels forget to write is NaN, not leftover memory


def make_batch(queries: list[int], contexts: list[int], block_size: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, seed: int = 0):
    """Caches holding each sequence's contexts[b] tokens in shuffled blocks (spare blocks: NaN, never to be read),
    tables one block wider than needed, context lengths and query_start_loc. Empty sequences: context 0."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks, spare = shuffled_block_tables(contexts, block_size, gen)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    for cache in (k_cache, v_cache):
        cache[spare] = float("nan")
    starts = torch.tensor([0] + queries, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return (k_cache.to(dtype).to(DEVICE), v_cache.to(dtype).to(DEVICE), tables.to(DEVICE),
            torch.tensor(contexts, dtype=torch.int32, device=DEVICE), starts.to(DEVICE))


def check(queries: list[int], contexts: list[int], *, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
          block_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0, pad_rows: int = 0,
          **kwargs) -> torch.Tensor:
    """verify_attention on the batch (plus `pad_rows` padding rows) against the fp64 reference; padding rows must be
    left unwritten (NaN from the poisoned allocation). Returns the output."""
    k_cache, v_cache, tables, lens, starts = make_batch(queries, contexts, block_size, kv_heads, head_dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    total = sum(queries)
    q = torch.randn(total + pad_rows, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    got = verify_attention(q, k_cache, v_cache, tables, lens, starts, scale, **kwargs)
    want = paged_attention_ref(q[:total].double(), k_cache.double(), v_cache.double(), tables, lens, starts, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got[:total].double(), want, **tol(dtype))
    assert got[total:].isnan().all()
    return got


@pytest.mark.parametrize("queries, contexts", [
    ([1], [1]),                                  # one row, one key
    ([5], [5]),                                  # a whole short prompt read back from the cache
    ([5], [21]),                                 # verify: 1 + 4 rows after 16 cached tokens (a block boundary)
    ([4], [38]),                                 # rows inside a block
    ([16], [40]),                                # 16 rows: early rows see no key of the last splits
    ([1, 5, 3], [1, 70, 19]),                    # a batch of verify steps of different lengths
    ([2, 0, 6, 0, 1], [9, 0, 33, 0, 48]),        # empty sequences between real ones
])
def test_matches_the_reference(queries, contexts):
    check(queries, contexts, min_split_tiles=1)


@pytest.mark.parametrize("num_programs, min_split_tiles", [
    (1, 1),       # one split per item (the programs are raised to the number of work items)
    (3, 1),       # splits that do not divide the programs
    (64, 1),      # more splits than tiles: one tile each, the rest empty
    (64, 3),      # at least three tiles per split
])
def test_any_split_of_the_context(num_programs, min_split_tiles):
    check([3, 7, 1], [90, 7, 61], num_programs=num_programs, min_split_tiles=min_split_tiles, seed=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit(dtype):
    check([4, 1, 5], [45, 20, 38], dtype=dtype, seed=3, num_programs=16, min_split_tiles=1)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (2, 2, 64, 16),     # MHA
    (8, 1, 128, 32),    # GROUP 8: query blocks of 4 rows in the interpreter, so 7 rows make two work items
    (12, 2, 256, 16),   # GROUP 6 (Qwen3.5-27B's), head_dim 256
    (6, 2, 24, 4),      # GROUP 3, head_dim not a power of two, 4-token blocks
])
def test_shapes(heads, kv_heads, head_dim, block_size):
    check([7, 2], [29, 50], heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, seed=7,
          num_programs=8, min_split_tiles=1)


def test_rows_beyond_max_query_len_are_still_attended():
    """max_query_len only sizes the query blocks: a sequence with more rows takes several work items."""
    check([9, 3], [30, 12], heads=8, kv_heads=2, max_query_len=2, num_programs=6, min_split_tiles=1, seed=4)


@pytest.mark.parametrize("queries, contexts, pad_rows, pad_seqs", [
    ([5], [37], 3, 7),                           # one verify step in a bucket of 8 rows, 8 sequences
    ([1, 4, 3], [17, 40, 9], 8, 5),              # a bucket of 16
    pytest.param([2, 1], [70, 33], 5, 69,        # more sequences than one scan chunk (SEQ_CHUNK = 64)
                 marks=pytest.mark.slow),
])
def test_fixed_launch_covers_padded_batches(queries, contexts, pad_rows, pad_seqs):
    """The CUDA-graph form: padding sequences (no rows, context 0, zero tables) and padding rows change nothing."""
    k_cache, v_cache, tables, lens, starts = make_batch(queries, contexts, 16, 2, 32, torch.float32, seed=5)
    total = sum(queries)
    q = torch.randn(total + pad_rows, 6, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    zeros = torch.zeros(pad_seqs, dtype=torch.int32, device=DEVICE)
    got = verify_attention(q, k_cache, v_cache, torch.cat([tables, zeros[:, None].expand(-1, tables.shape[1])]),
                           torch.cat([lens, zeros]), torch.cat([starts, starts[-1:].expand(pad_seqs)]), 0.2,
                           max_query_len=total + pad_rows, fixed_launch=True)
    want = paged_attention_ref(q[:total].double(), k_cache.double(), v_cache.double(), tables, lens, starts, 0.2)
    torch.testing.assert_close(got[:total].double(), want, **tol(torch.float32))
    assert got[total:].isnan().all()


def test_an_all_padding_batch_writes_nothing():
    """At graph capture every sequence is padding."""
    k_cache, v_cache, tables, _, _ = make_batch([1], [4], 16, 1, 16, torch.float32)
    zeros = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    got = verify_attention(torch.randn(8, 2, 16).to(DEVICE), k_cache, v_cache, tables.expand(3, -1).contiguous(),
                           zeros, torch.zeros(4, dtype=torch.int32, device=DEVICE), 0.25, fixed_launch=True)
    assert got.isnan().all()


# (Bad shapes: tests/test_extend_attention.py checks both kernels.)


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 32), (256, 16)])
def test_group_and_head_dim_matrix(group, head_dim, block_size):
    check([1, 5, 8], [3, 41, 77], heads=2 * group, kv_heads=2, head_dim=head_dim, block_size=block_size,
          num_programs=12, min_split_tiles=1, seed=group)


@pytest.mark.slow
@pytest.mark.parametrize("rows", range(1, 17))
def test_every_row_count_up_to_16(rows):
    check([rows, 1], [rows + 35, 20], heads=6, kv_heads=1, num_programs=10, min_split_tiles=1, seed=rows)


# --- dispatch ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """The kernel each paged_attention call reached, in order (the kernels themselves still run)."""
    seen: list[str] = []
    for name in ("paged_decode_attention", "verify_attention", "extend_attention"):
        real = getattr(decode_attention, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(decode_attention, name, spy)
    return seen


def test_paged_attention_dispatch(calls):
    """Decode rows -> flash-decoding; at most 16 rows per sequence (eager, or a graph bucket of <= 16 tokens) ->
    verify; more -> flash-decoding (varlen) for the one-row sequences and extend for the others. Every choice matches
    the reference."""
    k_cache, v_cache, tables, lens, starts = make_batch([1, 5, 12, 1], [9, 30, 40, 3], 16, 2, 16, torch.float32)
    q = torch.randn(40, 4, 16).to(DEVICE)  # rows past a batch's last sequence: padding

    def run(n_seqs: int, rows: int, **kwargs) -> None:
        lo, hi = starts[0], starts[n_seqs]
        s = starts[:n_seqs + 1] - lo
        got = decode_attention.paged_attention(q[lo:lo + rows], k_cache, v_cache, tables[:n_seqs], lens[:n_seqs], s,
                                               0.25, **kwargs)
        want = paged_attention_ref(q[lo:hi].double(), k_cache.double(), v_cache.double(), tables[:n_seqs],
                                   lens[:n_seqs], s, 0.25)
        torch.testing.assert_close(got[:hi - lo].double(), want, **tol(torch.float32))

    run(1, 1)                                        # one decode row
    run(2, 6, max_query_len=5)                       # a verify step, eager
    run(2, 6)                                        # max_query_len unknown: 6 rows in all bound it
    run(2, 8, max_query_len=8, fixed_launch=True)    # a graph bucket of 8 tokens
    run(1, 1, max_query_len=1, fixed_launch=True)    # a graph's one-row bucket: not the decode kernel
    run(3, 18, max_query_len=12)                     # a 12-row chunk beside them: still <= 16 rows per sequence
    run(3, 32, max_query_len=32, fixed_launch=True)  # a 32-token bucket: a sequence could have 32 rows
    run(3, 18)                                       # eager, 18 rows, no bound given
    assert calls == (["paged_decode_attention"] + ["verify_attention"] * 5
                     + ["paged_decode_attention", "extend_attention"] * 2)


# --- GPU: real head shapes, CUDA graphs -------------------------------------------------------------------------------

SHAPES = {"qwen3.5-27b": (24, 4, 256), "qwen3-8b": (32, 8, 128)}  # (q heads, kv heads, head_dim)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("queries, contexts", [
    ([5], [517]),                                # batch 1, k = 4 drafts
    ([4], [4099]),
    ([1, 5, 4, 2, 5, 3, 5, 1], [40, 2050, 700, 17, 1029, 333, 64, 9000]),
    ([8], [32771]),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_head_shapes(model, queries, contexts, dtype):
    heads, kv_heads, head_dim = SHAPES[model]
    check(queries, contexts, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, pad_rows=3,
          max_query_len=sum(queries) + 3, fixed_launch=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("model", list(SHAPES))
def test_gpu_cuda_graph_replays_other_lengths(model):
    """One capture of a 16-token bucket over 8 padded sequences (through paged_attention, as a mixed-step graph
    calls it), replayed with other batches, row counts and context lengths: each replay matches the reference and
    leaves its padding rows untouched."""
    heads, kv_heads, head_dim = SHAPES[model]
    bucket, max_seqs, block_size, width = 16, 8, 16, 260
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(max_seqs * width + 1, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(torch.bfloat16)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    q = torch.zeros(bucket, heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    lens = torch.zeros(max_seqs, dtype=torch.int32, device=DEVICE)
    starts = torch.zeros(max_seqs + 1, dtype=torch.int32, device=DEVICE)
    tables = torch.zeros(max_seqs, width, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5

    def forward() -> torch.Tensor:
        return decode_attention.paged_attention(q, k_cache, v_cache, tables, lens, starts, scale,
                                                max_query_len=bucket, fixed_launch=True)

    forward()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for seed, (queries, contexts) in enumerate([([5], [517]), ([1, 4, 5, 2], [4000, 90, 7, 1234]),
                                                ([16], [4100]), ([3] * 5, [33, 1, 2050, 64, 3])]):
        contexts = [max(c, n) for c, n in zip(contexts, queries)]
        n = len(queries)
        g = torch.Generator().manual_seed(seed)
        tables.zero_()
        tables[:n] = torch.randperm(max_seqs * width, generator=g)[:n * width].view(n, width).to(DEVICE)
        lens.zero_()
        lens[:n] = torch.tensor(contexts, dtype=torch.int32)
        starts.copy_(torch.tensor([0] + [sum(queries[:i + 1]) for i in range(n)] + [sum(queries)] * (max_seqs - n),
                                  dtype=torch.int32))
        q.copy_(torch.randn(bucket, heads, head_dim, generator=g).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        total = sum(queries)
        want = paged_attention_ref(q[:total].double(), k_cache.double(), v_cache.double(), tables[:n], lens[:n],
                                   starts[:n + 1], scale)
        torch.testing.assert_close(out[:total].double(), want, **tol(torch.bfloat16))
        assert out[total:].isnan().all()
