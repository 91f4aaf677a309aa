"""Automatic prefix caching: the block manager's hashing, reference counts and eviction on their own, then the engine
(tiny random Qwen models, fp32 CPU) giving the same greedy tokens with the cache as without it and as HF."""

from __future__ import annotations

import pytest
import torch

from hf_models import build_hf_model, hf_greedy, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.engine.multimodal import MultimodalInputs
from orinfer.engine.block_manager import BlockManager, block_hash
from orinfer.engine.sequence import Sequence

BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


# --- the block manager alone ----------------------------------------------------------------------------------------

def seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, tokens, SamplingParams(max_tokens=4))


def computed(manager: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence admitted and computed up to its last token (as the engine commits after a prefill)."""
    s = seq(tokens)
    manager.allocate(s)
    manager.commit(s, len(tokens) - 1)
    return s


def test_hash_chains_through_the_parent():
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4]) and a != block_hash(None, [1, 2, 3, 5])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert block_hash(None, [1, 23]) != block_hash(None, [12, 3])  # ids are separated, not concatenated digits


def test_a_later_prompt_gets_the_computed_full_blocks_of_its_prefix():
    manager = BlockManager(16, BLOCK)
    first = computed(manager, list(range(10)))           # blocks 0-3, 4-7 full and computed; 8-9 partial
    assert first.num_committed_blocks == 2 and len(manager.cached) == 2
    second = seq(list(range(8)) + [50, 51, 52])
    manager.allocate(second)
    assert second.num_cached_tokens == 8 and second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] not in first.block_table
    assert [manager.ref_counts[b] for b in first.block_table] == [2, 2, 1]


def test_at_least_one_token_is_left_to_compute():
    manager = BlockManager(16, BLOCK)
    computed(manager, list(range(9)))                    # two full blocks cached
    again = seq(list(range(8)))                           # exactly those two blocks: the last one is recomputed
    manager.allocate(again)
    assert again.num_cached_tokens == 4


def test_a_hit_ending_inside_a_block_reuses_only_whole_blocks():
    manager = BlockManager(16, BLOCK)
    computed(manager, list(range(13)))
    other = seq(list(range(10)) + [99, 98, 97])           # shares 10 tokens: 2 whole blocks
    manager.allocate(other)
    assert other.num_cached_tokens == 8


def test_freed_blocks_stay_findable_until_the_pool_needs_them():
    manager = BlockManager(6, BLOCK)
    first = computed(manager, list(range(9)))            # 3 blocks, 2 hashed
    cached = first.block_table[:2]
    manager.free(first)
    assert manager.num_free_blocks == 6 and manager.usage == 0.0
    # Unhashed free blocks are handed out first: a 3-block sequence leaves the cached ones alone...
    other = seq([70 + i for i in range(12)])
    manager.allocate(other)
    assert not set(cached) & set(other.block_table)
    hit = seq(list(range(8)) + [1])
    assert manager.can_allocate(hit)
    manager.allocate(hit)
    assert hit.num_cached_tokens == 8 and hit.block_table[:2] == cached
    # ...and when the pool runs out, the least recently freed hashed block is evicted and no longer found.
    manager.free(hit)
    manager.free(other)
    manager.allocate(seq([200 + i for i in range(21)]))  # 6 blocks: everything, the cached ones included
    late = seq(list(range(8)) + [1])
    assert manager._prefix_hits(late) == []
    assert not manager.cached


def test_can_allocate_counts_cached_blocks_taken_from_the_free_queue():
    manager = BlockManager(3, BLOCK)
    first = computed(manager, list(range(9)))
    manager.free(first)                                  # 3 free, 2 of them cached
    assert manager.can_allocate(seq(list(range(8)) + [5, 6, 7, 8]))  # 2 hits + 1 fresh = the whole pool
    held = seq([90, 91, 92])
    manager.allocate(held)                               # takes the unhashed free block
    assert not manager.can_allocate(seq(list(range(8)) + [5, 6, 7, 8]))
    assert manager.can_allocate(seq(list(range(8))))     # 1 hit + 1 fresh: the 2 free blocks


def test_disabled_cache_never_hits():
    off = BlockManager(8, BLOCK, enable_prefix_caching=False)
    computed(off, list(range(9)))
    s = seq(list(range(9)))
    off.allocate(s)
    assert s.num_cached_tokens == 0 and not off.cached


def with_image(tokens: list[int], image_start: int, digest: bytes) -> Sequence:
    """A sequence whose prompt holds an image starting at `image_start` (only what the block hash reads)."""
    s = seq(tokens)
    s.mm = MultimodalInputs(torch.zeros(0, 1), [], torch.zeros(3, 0, dtype=torch.int64), 0,
                            torch.zeros(0, dtype=torch.int64), [image_start], [digest])
    return s


def test_image_content_is_part_of_the_block_identity():
    """Same placeholder tokens, different image: the blocks from the image's start on are not shared; the blocks
    before it are, and the same image again hits all of them."""
    manager = BlockManager(16, BLOCK)
    tokens = list(range(13))
    first = with_image(tokens, 5, b"cat")
    manager.allocate(first)
    manager.commit(first, 13)
    other = with_image(tokens, 5, b"dog")
    manager.allocate(other)
    assert other.num_cached_tokens == 4                   # block 0 ends before the image (index 5, block 1)
    same = with_image(tokens, 5, b"cat")
    manager.allocate(same)
    assert same.num_cached_tokens == 12


def test_hit_counters():
    manager = BlockManager(16, BLOCK)
    computed(manager, list(range(9)))
    manager.allocate(seq(list(range(9))))
    assert (manager.num_queried_tokens, manager.num_hit_tokens) == (18, 8)


# --- the engine -----------------------------------------------------------------------------------------------------

SYSTEM = [5, 17, 42, 99, 3, 150, 7, 8, 61, 23, 9, 14]   # 12 tokens: three whole blocks of 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = build_hf_model("qwen3-gqa4-untied")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("prefix-cache"))


def engine(path, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=BLOCK, progress=False, **settings)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_waves_of_shared_prefixes_give_the_uncached_tokens(model, async_scheduling):
    """Wave 1 computes the shared prefix (its second prompt already reuses the blocks the first computes in the same
    step); wave 2's prompts find it (a hit ending at a block boundary, one ending inside a block, the whole prompt
    again) and decode exactly what an engine without the cache and HF decode."""
    hf, path = model
    cached = engine(path, async_scheduling=async_scheduling)
    plain = engine(path, async_scheduling=async_scheduling, enable_prefix_caching=False)
    wave1 = [SYSTEM + [11, 12], SYSTEM + [30, 31, 32, 33, 34]]
    wave2 = [SYSTEM + [40], SYSTEM[:10] + [60, 61, 62], SYSTEM + [11, 12], SYSTEM + [30, 31, 32, 33, 34, 35, 36]]
    for wave, hits in ((wave1, [0, 12]), (wave2, [12, 8, 12, 16])):
        got = cached.generate(wave, GREEDY)
        want = plain.generate(wave, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.token_ids for o in got] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in wave]
        assert all(o.num_cached_tokens == 0 for o in want)
        assert [o.num_cached_tokens for o in got] == hits
    manager = cached.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks          # everything released, cached blocks included
    assert manager.num_hit_tokens == 60


def test_preemption_with_a_tiny_pool_recomputes_from_the_cache(model):
    """A pool too small for the batch preempts sequences; their recompute finds their own freed blocks. Tokens are
    those of an engine without the cache."""
    hf, path = model
    prompts = [SYSTEM + [i, i + 1, i + 2] for i in range(40, 46)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cached = engine(path, num_kv_blocks=14)
    got = cached.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in got) > 0
    want = engine(path, num_kv_blocks=14, enable_prefix_caching=False).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert cached.engine.block_manager.num_free_blocks == 14


def test_sampling_seeds_and_logprobs_are_unchanged_by_a_hit(model):
    _, path = model
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, logprobs=2)
    prompt = SYSTEM + [77, 78]
    cached = engine(path)
    cached.generate(prompt, params)                       # fills the cache
    got = cached.generate(prompt, params)[0]
    want = engine(path, enable_prefix_caching=False).generate(prompt, params)[0]
    assert got.num_cached_tokens == 12 and got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_abort_keeps_the_computed_prefix_cached(model):
    _, path = model
    llm = engine(path)
    running = llm.engine.add_request(SYSTEM + [5, 6, 7, 8, 9], SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):                                    # the prefill and two decode steps (lookahead in flight)
        llm.engine.step()
    llm.engine.abort(running.request_id)
    while llm.engine.has_unfinished():                    # collects the step still in flight
        llm.engine.step()
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert llm.generate(SYSTEM + [1], GREEDY)[0].num_cached_tokens == 12


@pytest.mark.slow  # the whole model through Triton's CPU interpreter (30-80 s); CI's slow tier and the GPU run it
def test_triton_backend_reads_a_cached_prefix_like_the_torch_backend(model):
    """The triton op table (the interpreter without a GPU) on a hit: its prefill of the few new rows attends through
    the verify kernel (kernels/verify_attention.py), as a longer one would through the extend kernel."""
    from orinfer.engine.llm_engine import EngineParts
    from orinfer.layers.triton_ops import triton_ops
    from orinfer.loader import load_hf_model
    from orinfer.args import EngineArgs
    from orinfer.config import ModelConfig

    _, path = model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig.from_hf(path)
    ops = triton_ops()
    net = load_hf_model(path, ops, torch.float32, torch.float32, device, cfg, progress=False)
    llm = LLM.from_parts(EngineParts(net, cfg, None, {}, device, torch.float32, ops=ops),
                         EngineArgs(block_size=BLOCK, num_kv_blocks=64))
    prompts = [SYSTEM + [11, 12], SYSTEM + [60, 61, 62]]
    first = llm.generate(prompts[:1], GREEDY)
    second = llm.generate(prompts[1:], GREEDY)
    assert second[0].num_cached_tokens == 12
    want = engine(path, enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in first + second] == [o.token_ids for o in want]


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_start_up_warm_up_over_a_cached_context_fits_small_blocks(tiny_dir, block_size):
    """The GPU runner's warm-up of prompt rows over a cached context (run here on the CPU, where a block table too
    narrow for its context is an IndexError, not an illegal address) must give each row's context a table wide
    enough: with 4-token blocks, its 32 rows span 8 blocks."""
    from orinfer import LLM
    from orinfer.engine.warmup import _attention_classes, warm_cached_prefix
    from orinfer.kernels.verify_attention import verify_row_classes

    with LLM(tiny_dir, dtype="float32", device="cpu", progress=False, block_size=block_size) as llm:
        runner = llm.engine.runner
        seen = []
        forward = runner.model.forward

        def spy(ids, positions, meta, *args, **kwargs):
            seen.append((int(meta.context_lens.max()), meta.block_tables.shape[1]))
            return forward(ids, positions, meta, *args, **kwargs)

        runner.model.forward = spy
        warm_cached_prefix(runner)
    # each verify tile class, then the extend kernel's 32 rows, each over two table widths
    assert len(seen) == 2 * (len(verify_row_classes(*_attention_classes(runner))) + 1)
    assert all(width * block_size >= context for context, width in seen)


def test_the_prefill_warm_up_keeps_its_prompts_within_max_model_len(tiny_dir):
    """The GPU runner's warm-up of the largest step (run here on the CPU): its prompts are of at most 1024 tokens and
    max_model_len, so no position reads past the RoPE tables (a device-side assert on the GPU's torch backend, a
    read past the table in the Triton kernel)."""
    from orinfer import LLM
    from orinfer.engine.warmup import warm_prefill

    with LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_model_len=256, max_num_seqs=4,
             max_num_batched_tokens=600) as llm:
        runner = llm.engine.runner
        seen = []
        forward = runner.model.forward

        def spy(ids, positions, meta, *args, **kwargs):
            seen.append((meta.query_start_loc.diff().tolist(), int(positions.max())))
            return forward(ids, positions, meta, *args, **kwargs)

        runner.model.forward = spy
        warm_prefill(runner)
    assert seen == [([256, 256, 88], 255)]


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_mixed_step_warm_up_runs_decode_rows_beside_a_chunk(tiny_dir, block_size):
    """The GPU runner's mixed-step warm-up (run here on the CPU, with the interpreter's stand-in of 4 SMs): one
    forward per class of the decode kernel's launch, each of one-row sequences beside a chunk past VERIFY_MAX_ROWS
    rows, with a block table wide enough for the chunk's context."""
    from orinfer import LLM
    from orinfer.engine.warmup import mixed_step_classes, warm_mixed_steps
    from orinfer.kernels.verify_attention import VERIFY_MAX_ROWS

    with LLM(tiny_dir, dtype="float32", device="cpu", progress=False, block_size=block_size, max_num_seqs=8,
             max_model_len=256) as llm:
        runner = llm.engine.runner
        seen = []
        forward = runner.model.forward

        def spy(ids, positions, meta, *args, **kwargs):
            seen.append((meta.query_start_loc.diff().tolist(), meta.context_lens.tolist(), meta.block_tables.shape[1]))
            return forward(ids, positions, meta, *args, **kwargs)

        runner.model.forward = spy
        warm_mixed_steps(runner)
        want = mixed_step_classes(runner)
    assert want and [rows for rows, _, _ in seen] == [[1] * (b - 1) + [VERIFY_MAX_ROWS + 1] for b, _ in want]
    assert all(context == rows and width * block_size >= rows[-1] for rows, context, width in seen)
    assert [width for _, _, width in seen] == [w for _, w in want]


def test_mixed_step_classes_cover_every_decode_launch_on_an_h200():
    """Qwen3-8B's heads on an H200 (132 SMs, 8 kv heads), up to 64 sequences and a 4096-token context: the classes
    hold every (tile, split or not, merge width) an eager mixed step's decode rows can take, once each."""
    from types import SimpleNamespace
    from unittest import mock

    import triton

    from orinfer.engine import warmup
    from orinfer.kernels import decode_attention

    runner = SimpleNamespace(block_size=16, max_model_len=4096, config=SimpleNamespace(max_num_seqs=64),
                             model_config=SimpleNamespace(num_key_value_heads=8, num_attention_heads=32, head_dim=128),
                             device=torch.device("cuda"), kv_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)

    def launch(batch: int, width: int) -> tuple:
        tile = decode_attention.default_tile(128, False, False, batch * 8, 132)
        splits = decode_attention.default_num_splits(batch, 8, triton.cdiv(width * 16, tile.block_n),
                                                     torch.device("cuda"))
        return tile, splits > 1, decode_attention.combine_width(splits) if splits > 1 else 0

    # (the interpreter takes exact fp32 dots even for 16-bit caches; the GPU takes tensor-core dots)
    with mock.patch.object(decode_attention, "num_sms", lambda device: 132), \
            mock.patch.object(warmup, "exact_fp32_dots", lambda *dtypes: False):
        classes = warmup.mixed_step_classes(runner)
        launches = [launch(b, w) for b, w in classes]
        every = {launch(b, w) for b in range(2, 65) for w in range(2, 257)}
    assert len(set(launches)) == len(launches) and set(launches) == every
    assert len({tile for tile, _, _ in every}) == 3 and {split for _, split, _ in every} == {False, True}
