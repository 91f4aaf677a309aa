"""Prefix caching for Qwen3.5 (hybrid models): a hit resumes the linear-attention state from a snapshot taken where
an earlier prompt's last full block ended (engine/block_manager.py). Greedy tokens against HF transformers' own
classes (tiny random models, fp32 CPU) for later turns of a conversation, repeated prompts, chunked prompts beside
decode rows, lookahead on and off, snapshots evicted by their LRU or with their blocks, and preemption; unit tests of
the block manager's snapshot bookkeeping."""

from __future__ import annotations

import pytest
import torch

from hf_models import build_hf_qwen3_5, hf_greedy, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.engine.block_manager import BlockManager
from orinfer.engine.sequence import Sequence

STEPS = 6
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
BLOCK = 4
TURN1 = [5, 17, 42, 99, 3, 150, 7, 8, 61, 23, 9, 14, 33]                 # 13 tokens: snapshot after 12


@pytest.fixture(scope="module", params=["qwen3.5-interval4-untied", "qwen3.5-mixed-tied"])
def model(request, tmp_path_factory):
    hf = build_hf_qwen3_5(request.param)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp(request.param))


def engine(path, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=BLOCK, progress=False, **settings)


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 5}, {"async_scheduling": False},
                                      {"max_num_batched_tokens": 3, "async_scheduling": False}])
def test_a_later_turn_resumes_from_the_earlier_prompts_state(model, settings):
    """Turn 2's prompt is turn 1's prompt, its answer and a new message: it takes turn 1's first 12 tokens from the
    cache (KV and state) and computes the rest; a repeat of turn 1 hits the same 12."""
    hf, path = model
    llm = engine(path, **settings)
    first = llm.generate([TURN1], GREEDY)[0]
    assert first.token_ids == hf_greedy(hf, TURN1, STEPS) and first.num_cached_tokens == 0
    turn2 = TURN1 + first.token_ids + [11, 200, 14]
    again, second = llm.generate([TURN1, turn2], GREEDY)
    assert again.num_cached_tokens == 12 and again.token_ids == first.token_ids
    assert second.num_cached_tokens == 12
    assert second.token_ids == hf_greedy(hf, turn2, STEPS)
    # Turn 2 left its own snapshot (after 20 of its 22 prompt tokens): turn 3 resumes there.
    turn3 = turn2 + second.token_ids + [88, 7]
    third = llm.generate([turn3], GREEDY)[0]
    assert third.num_cached_tokens == 20 and third.token_ids == hf_greedy(hf, turn3, STEPS)


def test_prompts_admitted_in_one_step_share_no_unsaved_snapshot(model):
    """Two requests with the same prompt in one step: the second cannot resume from a state the first has not
    computed yet (its KV blocks are shared, its state is not), so it computes its state from the start."""
    hf, path = model
    outs = engine(path).generate([TURN1, TURN1 + [1, 2]], GREEDY)
    assert outs[1].num_cached_tokens == 0
    assert [o.token_ids for o in outs] == [hf_greedy(hf, TURN1, STEPS), hf_greedy(hf, TURN1 + [1, 2], STEPS)]


def test_snapshots_are_evicted_least_recently_used(model):
    """One snapshot slot: each new prompt's snapshot replaces the last, and only the latest prompt's prefix hits."""
    hf, path = model
    llm = engine(path, num_state_snapshots=1)
    other = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    llm.generate([TURN1], GREEDY)
    llm.generate([other], GREEDY)  # takes the only slot
    evicted, kept = llm.generate([TURN1 + [4], other + [4]], GREEDY)
    assert (evicted.num_cached_tokens, kept.num_cached_tokens) == (0, 8)
    assert evicted.token_ids == hf_greedy(hf, TURN1 + [4], STEPS)
    assert kept.token_ids == hf_greedy(hf, other + [4], STEPS)


def test_a_snapshot_goes_with_its_block_and_preemption_recomputes(model):
    """A pool of 9 blocks: prompts evict each other's blocks (and with them the snapshots) and running sequences are
    preempted; every output is HF's and nothing stale is hit."""
    hf, path = model
    llm = engine(path, num_kv_blocks=9, max_num_batched_tokens=6)
    prompts = [TURN1, [7] * 15 + [1, 2, 3], TURN1 + [5, 5], [88, 3]]
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, STEPS) for p in prompts]
    manager = llm.engine.block_manager
    assert set(manager.snapshots) <= set(manager.cached)  # every kept snapshot's block is still findable
    again = llm.generate([TURN1 + [5, 5]], GREEDY)[0]
    assert again.token_ids == hf_greedy(hf, TURN1 + [5, 5], STEPS)


def test_no_prefix_caching_keeps_no_snapshots(model):
    hf, path = model
    llm = engine(path, enable_prefix_caching=False)
    assert llm.engine.runner.state.num_snapshots == 0 and not llm.engine.block_manager.takes_snapshots
    outs = llm.generate([TURN1, TURN1], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert outs[1].token_ids == hf_greedy(hf, TURN1, STEPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_snapshots_on_the_gpu_with_graphs(model):
    """The triton backend on the GPU, fp32, CUDA graphs: the snapshot copies are queued in stream order with graph
    replays (decode and mixed steps), and turn 2 still gives HF's tokens from 12 cached tokens."""
    hf, path = model
    llm = LLM(path, dtype="float32", device="cuda", backend="triton", block_size=BLOCK, kv_cache_bytes=64 << 20,
              max_num_seqs=8, max_num_batched_tokens=6, progress=False)
    first = llm.generate([TURN1], GREEDY)[0]
    turn2 = TURN1 + first.token_ids + [11, 200, 14]
    outs = llm.generate([turn2, [88, 3, 5]], GREEDY)
    assert outs[0].num_cached_tokens == 12
    assert [o.token_ids for o in outs] == [hf_greedy(hf, turn2, STEPS), hf_greedy(hf, [88, 3, 5], STEPS)]


# --- the block manager's bookkeeping -----------------------------------------------------------------------------

def _seq(tokens: list[int]) -> Sequence:
    return Sequence(f"r{len(tokens)}-{tokens[0]}", tokens, GREEDY)


def _compute(manager: BlockManager, seq: Sequence) -> int | None:
    """What the engine does for a prompt computed whole: registers its blocks, saves its snapshot."""
    manager.allocate(seq)
    seq.num_computed_tokens = manager.snapshot_point(seq)
    manager.commit(seq, len(seq.token_ids))
    return manager.save_snapshot(seq)


def test_hits_stop_at_the_deepest_block_with_a_snapshot():
    manager = BlockManager(num_blocks=16, block_size=4, num_state_slots=2, num_state_snapshots=2)
    first = _seq(list(range(1, 14)))            # 13 tokens: three full blocks, snapshot after 12
    assert manager.snapshot_point(first) == 12 and _compute(manager, first) == 0
    manager.free(first)
    # Every full block is cached, but only the third has a state: a prompt sharing two blocks hits nothing.
    assert manager.cached_prefix_tokens(_seq(list(range(1, 9)) + [99, 98])) == 0
    longer = _seq(list(range(1, 14)) + [50, 51])
    assert manager.cached_prefix_tokens(longer) == 12
    manager.allocate(longer)
    assert longer.restore_snapshot == 0 and longer.num_cached_tokens == 12
    manager.free(longer)
    assert longer.restore_snapshot == -1


def test_snapshot_slots_are_reused_lru_and_dropped_with_their_block():
    manager = BlockManager(num_blocks=6, block_size=4, num_state_slots=1, num_state_snapshots=1)
    a, b = _seq([1, 2, 3, 4, 5]), _seq([6, 7, 8, 9, 10])
    assert _compute(manager, a) == 0
    manager.free(a)
    assert _compute(manager, b) == 0  # the only slot, taken from a's snapshot
    manager.free(b)
    assert list(manager.snapshots) == [b.block_chain[0]] and not manager.free_snapshots
    # Six fresh blocks evict every cached one, b's included: its snapshot slot is free again.
    big = _seq(list(range(100, 124)))
    manager.allocate(big)
    assert not manager.snapshots and manager.free_snapshots == [0]


def test_snapshots_need_prefix_caching_or_are_not_kept():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False, num_state_slots=1)
    assert not manager.takes_snapshots and manager.snapshot_point(_seq([1, 2, 3, 4, 5])) == 0
    with pytest.raises(ValueError, match="snapshots"):
        BlockManager(num_blocks=4, block_size=4, num_state_slots=1, num_state_snapshots=0)
