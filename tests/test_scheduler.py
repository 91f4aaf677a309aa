"""The scheduler and the block manager on their own: Sequence objects made by hand, no model, no engine.

The helpers drive them the way LLMEngine does: `schedule()` plans a step (decode rows and prompt chunks), launching it
advances each sequence's computed tokens and gives the sequences that reached their newest token a sampled one
(`step`), a finished or aborted sequence goes through `Scheduler.finish`, and a lookahead step is a
`plan_lookahead` on a batch whose tokens are still pending (`num_pending`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable

import pytest

from orinfer.args import EngineArgs
from orinfer.engine.block_manager import BlockManager
from orinfer.engine.scheduler import Scheduler, StepPlan
from orinfer.engine.sequence import Sequence, SequenceStatus
from orinfer.sampling_params import SamplingParams

BLOCK = 4   # tokens per block in every test


# --- helpers --------------------------------------------------------------------------------------------------------

_prompts = itertools.count(1)


def seq(name: str, num_tokens: int) -> Sequence:
    """A sequence whose prompt is `num_tokens` tokens long (its own tokens: no prefix shared with another)."""
    base = next(_prompts) * 1000
    return Sequence(name, list(range(base, base + num_tokens)), SamplingParams())


def scheduler(num_blocks: int, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 1024,
              chunked: bool = True, long_prefill_token_threshold: int = 1024) -> Scheduler:
    config = EngineArgs(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=BLOCK,
                        enable_chunked_prefill=chunked, long_prefill_token_threshold=long_prefill_token_threshold)
    return Scheduler(config, BlockManager(num_blocks, BLOCK))


def admit(sched: Scheduler, *seqs: Sequence) -> None:
    for s in seqs:
        sched.add(s)


def launch_plan(plan: StepPlan) -> None:
    """What the engine does when it launches a plan: the planned tokens count as computed; each sequence that reached
    its newest token gets a pending one."""
    sampled = plan.sampled
    for s, n in zip(plan.seqs, plan.num_new_tokens):
        s.num_computed_tokens += n
    for s in sampled:
        s.num_pending += 1


def step(sched: Scheduler) -> list[tuple[str, int]]:
    """One engine step without lookahead: schedule, launch, and each sampling sequence gets its token.
    Returns (request id, tokens run) per row of the plan."""
    plan = sched.schedule()
    launch_plan(plan)
    for s in plan.seqs:
        if s.num_pending:
            s.resolve_pending(7)
    return [(s.request_id, n) for s, n in zip(plan.seqs, plan.num_new_tokens)]


def decodes(*names: str) -> list[tuple[str, int]]:
    return [(name, 1) for name in names]


def launch(batch: list[Sequence]) -> None:
    """A lookahead decode step launched for `batch`: each sequence has one more token, still on the device."""
    for s in batch:
        s.num_computed_tokens += 1
        s.num_pending += 1


def ids(queue: Iterable[Sequence]) -> list[str]:
    return [s.request_id for s in queue]


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


def state(sched: Scheduler, seqs: list[Sequence]) -> tuple:
    """Everything plan_lookahead could change, for before/after comparisons."""
    return ({s.request_id: list(s.block_table) for s in seqs}, list(sched.block_manager.free_blocks),
            ids(sched.waiting), ids(sched.running), [s.status for s in seqs])


def check_invariants(sched: Scheduler, live: list[Sequence]) -> None:
    """Every block has exactly one owner or is free; queues and statuses agree; a running sequence holds exactly
    the blocks of its tokens (minus the newest one, which the next decode step writes); no more than max_num_seqs
    run."""
    bm = sched.block_manager
    owned = [b for s in live for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block is held by two sequences"
    assert not set(owned) & set(bm.free_blocks), "a held block is also free"
    assert sorted(owned + list(bm.free_blocks)) == list(range(bm.num_blocks)), "a block leaked or was duplicated"
    assert sorted(ids(sched.running) + ids(sched.waiting)) == sorted(s.request_id for s in live)
    assert len(sched.running) <= sched.config.max_num_seqs
    for s in sched.running:
        assert s.status is SequenceStatus.RUNNING
        assert s.num_computed_tokens < s.num_tokens
        # The blocks of its tokens (admission), or of all but the newest one (decoding: the next row writes it).
        assert blocks_for(s.num_tokens - 1) <= len(s.block_table) <= blocks_for(s.num_tokens)
    for s in sched.waiting:
        assert s.status is SequenceStatus.WAITING and s.block_table == []


# --- the token budget: decodes first, then prompt chunks, FIFO, max_num_seqs -----------------------------------------

def test_decodes_come_first_and_prompts_share_the_rest_of_the_budget_in_fifo_order() -> None:
    sched = scheduler(64, max_num_batched_tokens=10)
    admit(sched, seq("a", 4), seq("b", 6), seq("c", 8), seq("d", 3), seq("e", 2))
    assert step(sched) == [("a", 4), ("b", 6)]                    # exactly the budget
    assert ids(sched.waiting) == ["c", "d", "e"]
    # a and b decode; c's 8 tokens fill the rest.
    assert step(sched) == decodes("a", "b") + [("c", 8)]
    assert step(sched) == decodes("a", "b", "c") + [("d", 3), ("e", 2)]
    assert ids(sched.running) == ["a", "b", "c", "d", "e"]
    assert step(sched) == decodes("a", "b", "c", "d", "e")


def test_long_prompts_run_in_chunks_beside_decoding_streams() -> None:
    sched = scheduler(64, max_num_batched_tokens=10)
    a, long = seq("a", 3), seq("long", 25)
    admit(sched, a, long)
    assert step(sched) == [("a", 3), ("long", 7)]
    assert long.num_computed_tokens == 7 and not long.num_completion_tokens    # no token sampled mid-prompt
    assert step(sched) == decodes("a") + [("long", 9)]
    assert step(sched) == decodes("a") + [("long", 9)]
    assert long.num_completion_tokens == 1                        # the last chunk sampled its first token
    assert step(sched) == decodes("a", "long")
    assert len(long.block_table) == blocks_for(25)


def test_a_chunk_budget_of_one_token() -> None:
    sched = scheduler(64, max_num_batched_tokens=1)
    a, b = seq("a", 3), seq("b", 2)
    admit(sched, a, b)
    assert [step(sched) for _ in range(3)] == [[("a", 1)], [("a", 1)], [("a", 1)]]
    # a decodes every step (decode rows always run); b waits for a budget that a's decode leaves empty.
    assert step(sched) == decodes("a") and ids(sched.waiting) == ["b"]
    sched.finish(a)
    assert [step(sched) for _ in range(3)] == [[("b", 1)], [("b", 1)], decodes("b")]


def test_without_chunking_a_prompt_runs_whole() -> None:
    sched = scheduler(64, max_num_batched_tokens=10, chunked=False)
    admit(sched, seq("short", 3), seq("long", 25), seq("after", 2))
    assert step(sched) == [("short", 3)]            # 3 + 25 > 10: long waits for a step without another prompt
    assert step(sched) == decodes("short") + [("long", 25)]       # over the budget, but not never
    assert step(sched) == decodes("short", "long") + [("after", 2)]


def test_beside_decode_rows_a_chunk_pays_for_its_attention_to_the_context() -> None:
    """With keys_per_token = 8: a chunk of n tokens after c computed ones costs n + n (c + n/2) / 8 of the budget
    when decode rows share the step, and just n when it runs alone."""
    config = EngineArgs(max_num_seqs=8, max_num_batched_tokens=20, block_size=BLOCK)
    sched = Scheduler(config, BlockManager(64, BLOCK), keys_per_token=8.0)
    a, long = seq("a", 3), seq("long", 60)
    admit(sched, a, long)
    assert step(sched) == [("a", 3), ("long", 17)]                # no decode rows yet: tokens only
    # a decodes; 19 left for long at c = 17: n + n (17 + n/2) / 8 <= 19 gives n = 5 (17.2; 6 would cost 21).
    assert step(sched) == decodes("a") + [("long", 5)]
    assert sched._cost(5, 17, True) <= 19 < sched._cost(6, 17, True)
    sched.finish(a)
    assert step(sched) == [("long", 20)]                          # alone again: the whole budget


def test_attention_keys_per_token_of_qwen3_8b() -> None:
    from orinfer.config import preset
    from orinfer.engine.scheduler import attention_keys_per_token

    assert 11_000 < attention_keys_per_token(preset("qwen3-8b")) < 12_500


def test_max_num_seqs_caps_running_and_admits_as_others_finish() -> None:
    sched = scheduler(64, max_num_seqs=2)
    s0, s1, s2, s3 = (seq(f"s{i}", 3) for i in range(4))
    admit(sched, s0, s1, s2, s3)
    assert step(sched) == [("s0", 3), ("s1", 3)]
    assert ids(sched.waiting) == ["s2", "s3"]
    assert step(sched) == decodes("s0", "s1")     # full: the queue waits, the running ones decode
    sched.finish(s0)
    assert step(sched) == decodes("s1") + [("s2", 3)]
    assert ids(sched.running) == ["s1", "s2"] and ids(sched.waiting) == ["s3"]
    sched.finish(s1)
    sched.finish(s2)
    assert step(sched) == [("s3", 3)]
    assert ids(sched.running) == ["s3"] and not sched.waiting


def test_identical_prompts_admitted_together_share_the_blocks_the_first_computes() -> None:
    """The choices of an n > 1 request: the second finds the first's full blocks, registered when it was planned."""
    sched = scheduler(16)
    first = Sequence("n0", list(range(50, 60)), SamplingParams())
    second = Sequence("n1", list(range(50, 60)), SamplingParams())
    admit(sched, first, second)
    assert step(sched) == [("n0", 10), ("n1", 2)]
    assert second.num_cached_tokens == 8 and second.block_table[:2] == first.block_table[:2]


# --- decode ----------------------------------------------------------------------------------------------------------

def test_decode_gives_every_running_sequence_a_slot_for_its_newest_token() -> None:
    sched = scheduler(16)
    a, b = seq("a", 3), seq("b", 4)
    admit(sched, a, b)
    step(sched)                                      # prefill: a holds 1 block (3 tokens), b 1 block (4 tokens)
    assert (len(a.block_table), len(b.block_table)) == (1, 1)
    tables = {"a": [], "b": []}
    for _ in range(6):
        before = {s.request_id: list(s.block_table) for s in (a, b)}
        assert step(sched) == decodes("a", "b")
        for s in (a, b):
            written = s.num_tokens - 1               # the decode step wrote the KV of the token sampled before it
            assert len(s.block_table) == blocks_for(written)
            assert s.block_table[:len(before[s.request_id])] == before[s.request_id]   # only appended to
            tables[s.request_id].append(len(s.block_table))
    # a writes tokens 4..9, b tokens 5..10: a new block exactly when token 5 and token 9 are written.
    assert tables == {"a": [1, 2, 2, 2, 2, 3], "b": [2, 2, 2, 2, 3, 3]}


# --- preemption ----------------------------------------------------------------------------------------------------

def test_preemption_takes_the_most_recently_admitted_first_and_recomputes_it_later() -> None:
    sched = scheduler(3, max_num_seqs=3)
    a, b, c, d = seq("a", 4), seq("b", 2), seq("c", 2), seq("d", 4)
    admit(sched, a, b, c, d)
    assert step(sched) == [("a", 4), ("b", 2), ("c", 2)]   # one block each, none left; d waits (max_num_seqs)
    c_block = c.block_table[0]
    # a (now 5 tokens) needs a second block; b and c (3 tokens) do not. c, admitted last, gives up its block.
    assert step(sched) == decodes("a", "b")
    assert a.block_table[1] == c_block
    assert ids(sched.running) == ["a", "b"]
    assert ids(sched.waiting) == ["c", "d"]          # at the front, ahead of d
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_preemptions == 1
    assert [s.num_preemptions for s in (a, b, d)] == [0, 0, 0]
    assert sched.block_manager.num_free_blocks == 0
    sched.finish(a)                                  # frees 2 blocks
    plan = sched.schedule()
    assert ids(plan.seqs) == ["b", "c", "d"] and plan.num_new_tokens == [1, 3, 4]
    # Recomputed: its prompt and the token it had generated, in one block.
    assert c.status is SequenceStatus.RUNNING and c.token_ids[2:] == [7] and len(c.block_table) == 1
    assert ids(sched.running) == ["b", "c", "d"] and not sched.waiting


def test_several_preemptions_in_one_step_keep_the_queue_in_admission_order() -> None:
    sched = scheduler(4)
    a, b, c, d = (seq(name, 4) for name in "abcd")
    admit(sched, a, b, c, d)
    step(sched)                                      # one block each, none free; all need a second one
    c_block, d_block = c.block_table[0], d.block_table[0]
    # a takes d's block, b takes c's: the newest go first, and back to the queue in their original order.
    assert step(sched) == decodes("a", "b")
    assert (a.block_table[1], b.block_table[1]) == (d_block, c_block)
    assert ids(sched.waiting) == ["c", "d"]
    assert [s.num_preemptions for s in (a, b, c, d)] == [0, 0, 1, 1]
    sched.finish(b)
    assert step(sched) == decodes("a") + [("c", 5)]  # c (5 tokens) gets b's 2 blocks; d must wait for more
    assert ids(sched.waiting) == ["d"]


def test_a_lone_sequence_that_cannot_grow_preempts_itself() -> None:
    sched = scheduler(2)
    a = seq("a", 8)
    admit(sched, a)
    step(sched)                                      # 9 tokens: needs a third block, and the pool has two
    assert step(sched) == []
    assert ids(sched.waiting) == ["a"] and a.num_preemptions == 1 and a.block_table == []
    assert sched.block_manager.num_free_blocks == 2


def test_a_long_prompt_beside_decoding_streams_goes_in_smaller_chunks() -> None:
    """long_prefill_token_threshold: beside decode rows a prompt's chunk holds at most the threshold (so streams wait
    less for the step), each prompt on its own; alone, a prompt takes the whole budget; 0 turns it off."""
    alone = scheduler(64, max_num_batched_tokens=20, long_prefill_token_threshold=6)
    admit(alone, seq("alone", 50))
    assert step(alone) == [("alone", 20)]            # no stream waits: the whole budget
    sched = scheduler(64, max_num_batched_tokens=20, long_prefill_token_threshold=6)
    long, a, b = seq("long", 50), seq("a", 2), seq("b", 9)
    admit(sched, a)
    assert step(sched) == [("a", 2)]
    admit(sched, long)
    assert step(sched) == [("a", 1), ("long", 6)]    # beside a's decode row: at most 6
    assert step(sched) == [("a", 1), ("long", 6)]
    admit(sched, b)
    assert step(sched) == [("a", 1), ("long", 6), ("b", 6)]  # each prompt on its own
    off = scheduler(64, max_num_batched_tokens=20, long_prefill_token_threshold=0)
    x, y = seq("x", 2), seq("y", 50)
    admit(off, x)
    step(off)
    admit(off, y)
    assert step(off) == [("x", 1), ("y", 19)]
    with pytest.raises(Exception, match="long_prefill_token_threshold"):
        EngineArgs(long_prefill_token_threshold=-1)


def test_a_chunk_beside_decoding_streams_costs_at_most_the_threshold_with_its_attention() -> None:
    """Deep into a long prompt, the chunk's attention to its context counts against long_prefill_token_threshold
    too, not only against the step budget: beside a decode row a chunk's cost (tokens + attention in token
    equivalents) stays within the threshold, so the streams' pause does not grow with the context."""
    config = EngineArgs(max_num_seqs=8, max_num_batched_tokens=2048, block_size=BLOCK, long_prefill_token_threshold=512)
    sched = Scheduler(config, BlockManager(4096, BLOCK), keys_per_token=1000.0)
    stream, long = seq("stream", 2), seq("long", 6000)
    admit(sched, stream)
    step(sched)
    admit(sched, long)
    chunks = []
    while long.num_uncomputed_tokens > 1:
        context = long.num_computed_tokens
        chunk = dict(step(sched))["long"]
        chunks.append(chunk)
        assert sched._cost(chunk, context, True) <= 512
    assert chunks[0] < 512 <= sched._cost(chunks[0] + 1, 0, True)    # the first chunk pays its self-attention too
    assert chunks[-2] < chunks[0] / 3                                  # deep in the prompt, chunks shrink


# --- lookahead reservation -----------------------------------------------------------------------------------------

def decoding(sched: Scheduler, *seqs: Sequence) -> list[Sequence]:
    """Admits `seqs`, runs their prefill and launches a decode step; returns the decode batch."""
    admit(sched, *seqs)
    step(sched)
    plan = sched.schedule()
    assert plan.is_decode and plan.seqs == list(seqs)
    launch_plan(plan)
    return plan.seqs


def test_lookahead_reserves_the_next_slot() -> None:
    sched = scheduler(8)
    a, b = seq("a", 3), seq("b", 2)
    batch = decoding(sched, a, b)                    # a: 5 tokens with the pending one, b: 4
    assert sched.plan_lookahead(batch)
    assert (len(a.block_table), len(b.block_table)) == (2, 1)     # a crossed a block boundary, b did not
    assert sched.block_manager.num_free_blocks == 5
    assert ids(sched.running) == ["a", "b"] and not sched.waiting


def test_lookahead_plans_the_next_chunk_of_a_running_prompt_after_the_decode_rows() -> None:
    sched = scheduler(64, max_num_batched_tokens=6)
    a, long = seq("a", 3), seq("long", 20)
    admit(sched, a, long)
    assert step(sched) == [("a", 3), ("long", 3)]
    plan = sched.schedule()                          # a decodes; long's next chunk
    assert [(s.request_id, n) for s, n in zip(plan.seqs, plan.num_new_tokens)] == [("a", 1), ("long", 5)]
    launch_plan(plan)
    look = sched.plan_lookahead([a])
    assert [(s.request_id, n) for s, n in zip(look.seqs, look.num_new_tokens)] == [("a", 1), ("long", 5)]
    assert look.sampled == [a]


@pytest.mark.parametrize("why", ["batch is full", "head of the queue does not fit"])
def test_lookahead_goes_on_when_nothing_could_be_admitted(why: str) -> None:
    if why == "batch is full":
        sched, waiting = scheduler(8, max_num_seqs=2), seq("w", 1)
    else:
        sched, waiting = scheduler(4), seq("w", 9)   # needs 3 blocks, 2 are free
    a, b = seq("a", 3), seq("b", 2)
    batch = decoding(sched, a, b)
    admit(sched, waiting)
    assert sched.plan_lookahead(batch)
    assert (len(a.block_table), len(b.block_table)) == (2, 1)
    assert ids(sched.waiting) == ["w"] and waiting.block_table == []


def test_lookahead_admits_a_waiting_sequence_after_the_decode_rows() -> None:
    """A request that arrives while others decode joins the lookahead step (no drain), behind the decode rows, with
    its blocks allocated as `schedule` would; the queue's order and the budget hold."""
    sched = scheduler(8, max_num_batched_tokens=6)
    a, b, w, x = seq("a", 3), seq("b", 2), seq("w", 5), seq("x", 2)
    batch = decoding(sched, a, b)
    admit(sched, w, x)
    look = sched.plan_lookahead(batch)
    assert [(s.request_id, n) for s, n in zip(look.seqs, look.num_new_tokens)] == [("a", 1), ("b", 1), ("w", 4)]
    assert look.sampled == [a, b]                    # w's chunk ends inside its prompt: it samples nothing yet
    assert ids(sched.running) == ["a", "b", "w"] and ids(sched.waiting) == ["x"]
    assert len(w.block_table) == 2 and w.status.name == "RUNNING"  # its whole prompt (5 tokens, blocks of 4), as `_admit`


def test_lookahead_declines_when_blocks_do_not_suffice() -> None:
    sched = scheduler(3)
    a, b = seq("a", 3), seq("b", 3)
    batch = decoding(sched, a, b)                    # one block each, one free; both need a second one
    before = state(sched, [a, b])
    assert not sched.plan_lookahead(batch)
    assert state(sched, [a, b]) == before            # all or nothing: a did not take the free block
    assert sched.block_manager.num_free_blocks == 1


# --- finish and abort ----------------------------------------------------------------------------------------------

def test_finish_frees_blocks_of_running_and_waiting_sequences() -> None:
    sched = scheduler(4, max_num_seqs=2)
    a, b, c = seq("a", 4), seq("b", 5), seq("c", 3)
    admit(sched, a, b, c)
    step(sched)                                      # a: 1 block, b: 2 blocks; c waits
    assert sched.block_manager.num_free_blocks == 1
    sched.finish(c)                                  # abort of a sequence never admitted
    assert c.status is SequenceStatus.FINISHED and not sched.waiting
    assert sched.block_manager.num_free_blocks == 1
    sched.finish(b)
    assert b.status is SequenceStatus.FINISHED and b.block_table == [] and ids(sched.running) == ["a"]
    assert sched.block_manager.num_free_blocks == 3
    launch([a])                                      # an abort while a lookahead token is in flight drops it
    sched.finish(a)
    assert a.num_pending == 0 and a.block_table == []
    assert sched.block_manager.num_free_blocks == 4 and sched.block_manager.usage == 0.0
    assert not sched.has_unfinished()


def test_abort_of_a_preempted_sequence() -> None:
    sched = scheduler(2)
    a, b = seq("a", 4), seq("b", 4)
    admit(sched, a, b)
    step(sched)
    assert step(sched) == decodes("a")               # b preempted: its block went to a
    assert ids(sched.waiting) == ["b"] and b.block_table == []
    sched.finish(b)
    assert not sched.waiting and b.status is SequenceStatus.FINISHED
    sched.finish(a)
    assert sched.block_manager.num_free_blocks == 2 and not sched.has_unfinished()


def test_random_schedule_keeps_blocks_disjoint_and_returns_them_all() -> None:
    """A small pool under load: random arrivals, lengths, aborts and lookahead steps; invariants after every step."""
    rng = random.Random(20240601)
    num_blocks, budget = 12, 16
    sched = scheduler(num_blocks, max_num_seqs=4, max_num_batched_tokens=budget)
    live: list[Sequence] = []
    target: dict[str, int] = {}                      # total length at which a sequence finishes
    stats = dict.fromkeys(["prefills", "decodes", "chunks", "reserved", "lookahead chunks", "declined", "preempted",
                           "readmitted", "finished", "aborted"], 0)

    def end(s: Sequence) -> None:
        sched.finish(s)
        live.remove(s)

    for i in range(600):
        if i < 450 and rng.random() < 0.3:
            s = seq(f"r{i}", rng.randint(1, 20))
            # At most the pool less one block: a pending lookahead token must still fit.
            target[s.request_id] = rng.randint(s.num_tokens + 1, (num_blocks - 1) * BLOCK)
            admit(sched, s)
            live.append(s)
        queue_before = ids(sched.waiting)
        preemptions_before = sum(s.num_preemptions for s in live)
        plan = sched.schedule()
        batch = plan.seqs
        stats["preempted"] += sum(s.num_preemptions for s in live) - preemptions_before
        admitted = [s for s in batch if s.request_id in queue_before]
        assert ids(admitted) == queue_before[:len(admitted)]                        # FIFO
        decode_rows = sum(1 for s in batch if s.num_uncomputed_tokens == 1)
        assert plan.num_tokens <= max(budget, decode_rows)
        assert all(n <= s.num_uncomputed_tokens for s, n in zip(batch, plan.num_new_tokens))
        stats["readmitted"] += sum(1 for s in admitted if s.num_preemptions)
        stats["chunks"] += sum(1 for s, n in zip(batch, plan.num_new_tokens) if n < s.num_uncomputed_tokens)
        stats["decodes" if plan.is_decode and batch else "prefills"] += 1
        launch_plan(plan)
        stepped = list(batch)
        decoders = [s for s in sched.running if s.num_uncomputed_tokens == 1]
        if set(map(id, decoders)) <= set(map(id, plan.sampled)) and rng.random() < 0.5:
            look = sched.plan_lookahead(decoders)   # the engine's batch (none ends by length here: it cannot know)
            if look:
                stats["reserved"] += 1
                stats["lookahead chunks"] += any(n > 1 or not s.is_decoding for s, n in zip(look.seqs,
                                                                                           look.num_new_tokens))
                assert look.seqs[:len(decoders)] == decoders and look.num_tokens <= max(budget, len(decoders))
                launch_plan(look)
                stepped += [s for s in look.seqs if s not in stepped]
            else:
                stats["declined"] += 1
        for s in stepped:
            while s.num_pending and not s.is_finished:
                s.resolve_pending(rng.randrange(1000))
                if s.num_tokens >= target[s.request_id]:
                    end(s)                           # drops a lookahead token still pending
                    stats["finished"] += 1
        if live and rng.random() < 0.05:
            end(rng.choice(live))                    # abort, running or waiting
            stats["aborted"] += 1
        check_invariants(sched, live)

    for s in list(live):
        end(s)
    assert sched.block_manager.num_free_blocks == num_blocks and not sched.has_unfinished()
    assert all(stats.values()), stats                # the schedule went down every path
    assert stats["finished"] >= 50, stats


# --- BlockManager ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_blocks", [0, -1])
def test_block_manager_needs_a_block(num_blocks: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, BLOCK)


@pytest.mark.parametrize("num_tokens, blocks", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_at_block_boundaries(num_tokens: int, blocks: int) -> None:
    assert seq("x", 1).blocks_needed(BLOCK, num_tokens) == blocks
    if num_tokens:
        assert seq("x", num_tokens).blocks_needed(BLOCK) == blocks


def test_blocks_needed_counts_pending_tokens() -> None:
    s = seq("x", 8)
    assert s.blocks_needed(BLOCK) == 2
    s.num_pending = 1
    assert s.blocks_needed(BLOCK) == 3


def test_allocate_exactly_fills_the_pool_and_raises_without_room() -> None:
    bm = BlockManager(3, BLOCK)
    full, extra = seq("full", 12), seq("extra", 1)
    assert bm.can_allocate(full) and not bm.can_allocate(seq("over", 13))
    bm.allocate(full)
    assert full.block_table == [0, 1, 2] and bm.num_free_blocks == 0 and bm.usage == 1.0
    assert not bm.can_allocate(extra)
    with pytest.raises(RuntimeError):
        bm.allocate(extra)
    assert extra.block_table == [] and bm.num_free_blocks == 0


def test_append_slot_adds_a_block_only_past_a_boundary() -> None:
    bm = BlockManager(3, BLOCK)
    s = seq("s", 4)
    bm.allocate(s)
    assert s.block_table == [0]
    s.append_token(7)                                # token 5 starts a second block
    assert bm.can_append(s)
    bm.append_slot(s)
    assert s.block_table == [0, 1]
    for _ in range(3):                               # tokens 6..8 fit in it
        s.append_token(7)
        bm.append_slot(s)
    assert s.block_table == [0, 1] and bm.num_free_blocks == 1
    other = seq("other", 4)
    bm.allocate(other)                               # takes the last block
    s.append_token(7)                                # token 9: no block left
    assert not bm.can_append(s)
    assert bm.can_append(other)                      # other still has room in its block
    bm.free(other)
    assert bm.can_append(s)
    bm.append_slot(s)
    assert s.block_table == [0, 1, 2]


def test_usage_and_free_reuse_recent_blocks_first() -> None:
    bm = BlockManager(4, BLOCK)
    assert bm.usage == 0.0
    x, y = seq("x", 5), seq("y", 1)
    bm.allocate(x)
    bm.allocate(y)
    assert (x.block_table, y.block_table) == ([0, 1], [2])
    assert bm.usage == 0.75 and bm.num_free_blocks == 1
    bm.free(x)
    assert x.block_table == [] and bm.usage == 0.25
    assert list(bm.free_blocks) == [0, 1, 3]         # freed blocks go to the front, in table order
    z = seq("z", 6)
    bm.allocate(z)
    assert z.block_table == [0, 1]
    bm.free(z)
    bm.free(y)
    assert sorted(bm.free_blocks) == [0, 1, 2, 3] and bm.usage == 0.0
