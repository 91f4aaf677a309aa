"""The draft-model proposal graphs' host side (spec_decode/draft_graphs.py): which tokens a graph catch-up feeds, when
a catch-up runs eagerly first, the padded inputs, and the padded proposal itself run eagerly on the CPU (the work the
graphs capture, on the torch backend, fp32) against the eager proposer and plain decoding. The captured replay is
checked on the GPU in test_gpu_draft_graphs.py."""

from __future__ import annotations

import pytest
import torch

from orinfer import LLM, SamplingParams
from orinfer.spec_decode.draft_graphs import (DraftGraphs, advance_after_verify, graph_feed, graph_key,
                                             needs_eager_catch_up)
from orinfer.spec_decode.draft_model import DraftModelProposer
from orinfer.spec_decode.proposal_graphs import InputLayout, fill_inputs
from test_mtp_graphs import count_proposals, record_comparison
from test_spec_decode import perturbed_dir  # noqa: F401  (a fixture: a draft that agrees with tiny_dir often)

PROMPTS = ["Alice was beginning to get very tired", "Down, down, down. Would the fall never", "The rabbit-hole went"]
K = 4


def test_graph_feed_runs_the_unseen_tokens_through_the_newest():
    tokens = [10, 11, 12, 13, 14, 15]
    assert graph_feed(tokens, 5) == (5, [15])           # a partly accepted verify step: the newest token only
    assert graph_feed(tokens, 4) == (4, [14, 15])       # a fully accepted one: the last draft, then the newest
    assert graph_feed(tokens, 0) == (0, tokens)         # a new prompt (or a preemption's recompute)
    assert graph_feed(tokens, 9) == (5, [15])           # K/V ahead of the tokens: the newest row is still fed


def test_only_catch_ups_longer_than_the_graph_rows_run_eagerly_first():
    assert not needs_eager_catch_up(6, 5, 2) and not needs_eager_catch_up(6, 4, 2)
    assert needs_eager_catch_up(6, 3, 2)                # 3 rows: steps that did not speculate
    assert needs_eager_catch_up(6, 0, 2)                # a prompt
    assert not needs_eager_catch_up(6, 40, 2)


def test_graph_key_picks_the_bucket_and_the_one_row_graph():
    buckets = [1, 2, 4, 8]
    assert graph_key(buckets, [[7]]) == (1, True)
    assert graph_key(buckets, [[6, 7]]) == (1, False)  # a fully accepted verify step
    assert graph_key(buckets, [[7], [8], [9]]) == (4, True)
    assert graph_key(buckets, [[7], [8, 9], [9]]) == (4, False)
    assert graph_key(buckets, [[7]] * 9) is None        # more sequences than the largest bucket: eager
    graphs = DraftGraphs.__new__(DraftGraphs)
    graphs.buckets, graphs.max_blocks = buckets, 8
    assert graphs.key_for([[7], [8]], 8) == (2, True) and graphs.key_for([[7], [8]], 9) is None


def test_fill_inputs_places_a_draft_models_rows_after_the_newest_token():
    """A draft model feeds x_i at position i: newest index N = 6 (two rows: the last draft x5 and x6), so the steps
    run at positions 7 .. 9, and the catch-up's context ends past N."""
    layout = InputLayout(max_batch=2, k=K, max_blocks=3, rows_per_seq=2)
    host = {name: view.numpy() for name, view in layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8)).items()}
    first, feed = graph_feed([1, 2, 3, 4, 5, 50, 60], 5)
    assert fill_inputs(host, 2, K, [[3, 1, 4]], [feed], [first], block_size=4) == 2
    assert host["ids"].tolist() == [50, 60, 0, 0] and host["positions"].tolist() == [5, 6, 0, 0]
    assert host["slots"].tolist() == [1 * 4 + 1, 1 * 4 + 2, -1, -1]
    assert host["context_lens"].tolist() == [7, 0] and host["sample_rows"].tolist() == [1, 0]
    assert host["query_start_loc"].tolist() == [0, 2, 2]
    assert host["step_positions"][:, 0].tolist() == [7, 8, 9]
    assert host["step_slots"][:, 0].tolist() == [1 * 4 + 3, 4 * 4 + 0, 4 * 4 + 1]
    assert host["step_context_lens"][:, 0].tolist() == [8, 9, 10]
    assert host["step_slots"][:, 1].tolist() == [-1] * 3 and host["step_context_lens"][:, 1].tolist() == [1] * 3


def test_one_row_graphs_give_padding_sequences_a_decode_context():
    """The one-row graph's first forward is a decode step: padding sequences attend over one slot (context 1)."""
    graphs = DraftGraphs(None, K, 4, 3, 4, torch.device("cpu"))
    tables, feeds, firsts = [[3, 6], [5, 7]], [[9], [8]], [2, 1]
    assert graphs._fill((4, True), tables, feeds, firsts) == 2
    assert graphs.host["context_lens"].tolist() == [3, 2, 1, 1]
    assert graphs.host["ids"][:4].tolist() == [9, 8, 0, 0] and graphs.host["slots"][:4].tolist() == [14, 21, -1, -1]
    graphs._fill((4, False), tables, feeds, firsts)
    assert graphs.host["context_lens"].tolist() == [3, 2, 0, 0]  # the extend kernel's empty sequences


def test_inputs_advanced_on_the_device_equal_the_inputs_of_the_known_outcome():
    """A proposal queued behind its verify step: inputs filled for no accepted draft, then shifted by each sequence's
    accepted count on the device, equal the inputs filled once the outcome is known (`graph_feed`'s two rows ending
    at the token after the accepted run), for every count 0 .. k, across block boundaries; padding untouched."""
    block_size, bucket = 4, 4
    layout = InputLayout(max_batch=bucket, k=K, max_blocks=6, rows_per_seq=2)

    def views():
        return layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))

    tables = [[3, 1, 4, 9, 2], [5, 7, 8, 6, 0], [11, 12, 13, 14, 15]]
    newest = [5, 6, 11]        # positions of each sequence's newest token before the verify step
    verified = [[70, 71, 72, 73, 74], [80, 81, 82, 83, 84], [90, 91, 92, 93, 94]]  # x_P, then its K drafts
    for accepted in ([0, 2, K], [K, 0, 1], [1, K, 3]):
        emitted = [row[1:1 + a] + [100 + j] + [-1] * (K - a) for j, (row, a) in enumerate(zip(verified, accepted))]
        want = views()
        feeds = [[row[a], 100 + j] for j, (row, a) in enumerate(zip(verified, accepted))]
        fill_inputs({n: v.numpy() for n, v in want.items()}, bucket, K, tables, feeds,
                    [p + a for p, a in zip(newest, accepted)], block_size)
        got = views()
        fill_inputs({n: v.numpy() for n, v in got.items()}, bucket, K, tables, [[row[0], 0] for row in verified],
                    newest, block_size)
        advance_after_verify(got, 3, torch.tensor(accepted + [0]), torch.tensor(emitted + [[0] * (K + 1)]),
                             block_size)
        for name in want:
            assert torch.equal(got[name], want[name]), (accepted, name)


# --- the padded proposal on the CPU -----------------------------------------------------------------------------------

def engine(tiny_dir, draft_dir, spec: dict | None = None, **settings) -> LLM:
    """The tiny model with `draft_dir` drafting K tokens (`spec`: more speculative_config keys; None: no
    speculation when draft_dir is None)."""
    config = None if draft_dir is None else {"method": "draft_model", "model": str(draft_dir),
                                             "num_speculative_tokens": K, **(spec or {})}
    settings = {"max_num_seqs": 4, "max_model_len": 256, **settings}  # (a small KV pool: cheap to copy)
    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False, speculative_config=config, **settings)


def padded(llm: LLM, max_batch: int = 16) -> dict[str, int]:
    """Gives `llm`'s draft proposer uncaptured draft graphs (their padded work run eagerly, on the CPU); returns
    `count_proposals`' counters."""
    draft = llm.engine.draft
    runner = draft.runner
    assert draft.graphs is None  # the CPU never captures
    draft.graphs = DraftGraphs(runner.model, draft.k, max_batch, -(-runner.max_model_len // runner.block_size),
                               runner.block_size, runner.device)
    return count_proposals(draft)


def graph_kinds(draft: DraftModelProposer) -> list[bool]:
    """Records, for each proposal through `draft`'s graphs, whether it ran the one-row graph (filled as it runs)."""
    kinds, run = [], draft.graphs.run

    def recorded(key, *args, **kwargs):
        kinds.append(key[1])
        return run(key, *args, **kwargs)

    draft.graphs.run = recorded
    return kinds


def draft_both_ways(llm: LLM, tolerance: float) -> list[tuple[list, list]]:
    """Has every proposal of `llm` drafted by the graphs, then again eagerly from the state before it (the draft's
    KV cache and `num_draft_computed` restored): the two must leave the same cache, within `tolerance` (so the
    graph stored every entry the eager path does, and no other: padding rows store nothing). Returns the (graph,
    eager) drafts of each proposal, filled as `llm` runs; the engine goes on with the graph's drafts."""
    draft = llm.engine.draft
    caches = [cache for k_cache, v_cache in draft.runner.kv_caches for cache in (k_cache, v_cache)]
    run_graph = draft._draft
    run_eager = DraftModelProposer._draft_eager.__get__(draft)  # (not `count_proposals`' counted one)
    compared = []

    def both(seqs):
        before = [cache.clone() for cache in caches]
        computed = [seq.num_draft_computed for seq in seqs]
        got = run_graph(seqs).clone()
        after_graph = [cache.clone() for cache in caches]
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        for seq, n in zip(seqs, computed):
            seq.num_draft_computed = n
        record_comparison(compared, caches, after_graph, got, run_eager(seqs), tolerance)
        return got

    draft._draft = both
    return compared


def chained_both_ways(llm: LLM, tolerance: float) -> list[tuple[list, list]]:
    """Checks every proposal that was queued behind its verify step (spec_decode/chain.py) and taken by the next
    one against the eager proposal from the state after that step (`num_draft_computed` as it was): the same drafts,
    and the eager path finds nothing to change in the draft's KV cache (within `tolerance`). Returns the (queued,
    eager) drafts of each, filled as `llm` runs."""
    draft = llm.engine.draft
    caches = [cache for k_cache, v_cache in draft.runner.kv_caches for cache in (k_cache, v_cache)]
    adopt = draft.adopt
    run_eager = DraftModelProposer._draft_eager.__get__(draft)
    compared = []

    def both(drafts, seqs, rooms):
        computed = [seq.num_draft_computed for seq in seqs]
        taken = adopt(drafts, seqs, rooms)
        if taken is not None:
            after_queued = [cache.clone() for cache in caches]
            adopted = [seq.num_draft_computed for seq in seqs]
            for seq, n in zip(seqs, computed):
                seq.num_draft_computed = n
            record_comparison(compared, caches, after_queued, taken.ids.clone(), run_eager(seqs), tolerance)
            for seq, n in zip(seqs, adopted):
                seq.num_draft_computed = n
        return taken

    draft.adopt = both
    return compared


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tokens(llm: LLM, params, seed: int | None = None, prompts=PROMPTS) -> list[list[int]]:
    if seed is not None:
        torch.manual_seed(seed)  # forced acceptance draws its uniforms from the global generator
    outs = llm.generate(prompts, params)
    blocks = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and blocks.num_free_blocks == blocks.num_blocks
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return engine(tiny_dir, None)


@pytest.mark.parametrize("lookahead", [False, True])
def test_padded_proposals_draft_and_cache_what_the_eager_ones_do(tiny_dir, perturbed_dir, plain,  # noqa: F811
                                                                 lookahead):
    """A draft that agrees often: proposals after partly and fully accepted steps (1 and 2 catch-up rows), in a batch
    of three sequences with different acceptance, and the prompts' long catch-ups (run eagerly first). With the
    lookahead, most proposals are queued behind their verify step; those queued for a batch that then changes (a
    sequence finished) are dropped, and the next proposal runs as without the lookahead."""
    lengths = [40, 23, 31]  # the batch shrinks: several buckets
    params = [greedy(n) for n in lengths]
    llm = engine(tiny_dir, perturbed_dir, async_scheduling=lookahead)
    counts = padded(llm)
    kinds = graph_kinds(llm.engine.draft)
    compared = draft_both_ways(llm, 1e-5)
    chained = chained_both_ways(llm, 1e-5)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == tokens(plain, params)
    chain = llm.engine.chain
    assert counts["graph"] >= 10 and counts["eager"] == 0
    assert True in kinds and False in kinds  # both graphs of a bucket ran
    assert len(compared) + chain.num_queued == counts["graph"] and len(chained) == chain.num_taken
    if lookahead:
        assert chain.num_taken == chain.num_queued >= 5  # (none near max_tokens: `ProposalChain._room_after`)
    else:
        assert chain.num_queued == 0
    assert all(got == expected for got, expected in compared + chained)
    accepted = [o.metrics.num_accepted_tokens / o.metrics.num_draft_tokens for o in outs]
    assert 0 < min(accepted) < 1 and len(set(accepted)) > 1  # different acceptance within the batch


def test_the_model_as_its_own_draft_accepts_everything_through_the_graphs(tiny_dir, plain):
    """Every step fully accepted: each proposal's catch-up is the last draft and the newest token."""
    llm = engine(tiny_dir, tiny_dir)
    counts = padded(llm)
    compared = draft_both_ways(llm, 1e-5)
    chained = chained_both_ways(llm, 1e-5)
    outs = llm.generate(PROMPTS, greedy(41))
    assert [o.token_ids for o in outs] == tokens(plain, greedy(41))
    # 1 token from the prompt step, then 8 verify steps of 4 drafts + 1, all accepted. The first proposal follows the
    # prompt step; the next 7 are queued behind the verify step before them (none behind the last: max_tokens).
    assert [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in outs] == [(32, 32)] * 3
    assert counts["graph"] == 8 and len(compared) == 1 and len(chained) == 7 == llm.engine.chain.num_queued
    assert all(got == expected for got, expected in compared + chained)


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_forced_acceptance_gives_the_eager_paths_tokens(tiny_dir, perturbed_dir, acceptance):  # noqa: F811
    """Forced acceptance takes drafts whatever the target says: equal tokens mean equal drafts (at 1.0 the output
    is the drafts themselves)."""
    spec = {"forced_acceptance": acceptance}
    params = greedy(29)
    eager = tokens(engine(tiny_dir, perturbed_dir, spec), params, seed=0)
    llm = engine(tiny_dir, perturbed_dir, spec)
    counts = padded(llm)
    assert tokens(llm, params, seed=0) == eager
    assert counts["graph"] > 0


def test_batches_past_the_largest_bucket_draft_eagerly(tiny_dir, perturbed_dir, plain):  # noqa: F811
    """Largest bucket 2: while three sequences decode they draft eagerly, then the graphs take over."""
    lengths = [30, 9, 17]
    params = [greedy(n) for n in lengths]
    llm = engine(tiny_dir, perturbed_dir, {"forced_acceptance": 1.0})  # every step keeps speculating
    counts = padded(llm, max_batch=2)
    torch.manual_seed(0)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert counts["graph"] > 0 and counts["eager"] > 0
    assert tokens(engine(tiny_dir, perturbed_dir, {"forced_acceptance": 1.0}), params, seed=0) == got


def test_preemption_and_prefix_cache_hits_keep_greedy_output(tiny_dir, perturbed_dir, plain):  # noqa: F811
    """A pool too small for the batch preempts (the draft recomputes from its first token: a long catch-up); a prompt
    repeated later hits the prefix cache (its blocks hold both models' K/V)."""
    params = greedy(50)
    want = tokens(plain, params)
    tight = engine(tiny_dir, perturbed_dir, num_kv_blocks=9)
    counts = padded(tight)
    outs = tight.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0 and counts["graph"] > 0
    llm = engine(tiny_dir, perturbed_dir, block_size=4)  # (small blocks: the short prompts fill some)
    counts = padded(llm)
    compared = draft_both_ways(llm, 1e-5)
    assert tokens(llm, params, prompts=PROMPTS[:1]) == want[:1]
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], params)
    assert [o.token_ids for o in outs] == want[:2]
    assert outs[0].num_cached_tokens > 0
    assert counts["graph"] > 0 and all(got == expected for got, expected in compared)


def test_stops_inside_accepted_runs_with_proposals_queued_behind_verify_steps(tiny_dir, plain):
    """The model as its own draft accepts every draft, so a stop token, a stop string or max_tokens falls inside an
    accepted run while the next proposal is already queued: the output is plain decoding's, the queued proposal of
    the finished sequence is dropped, and every block comes back."""
    free = plain.generate(PROMPTS[:1], greedy(60))[0]
    stop_text = free.text[len(free.text) // 2:][:6]
    llm = engine(tiny_dir, tiny_dir)
    padded(llm)
    chain = llm.engine.chain
    for params, stops in ((SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[free.token_ids[27]],
                                          ignore_eos=True), True),
                          (SamplingParams(temperature=0.0, max_tokens=60, stop=[stop_text], ignore_eos=True), True),
                          (greedy(23), False)):
        queued, dropped = chain.num_queued, chain.num_queued - chain.num_taken
        want = plain.generate(PROMPTS, params)
        got = llm.generate(PROMPTS, params)
        assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in want]
        assert chain.num_queued > queued
        # A stop inside a run drops the proposal queued for the batch; max_tokens is foreseen (none queued there).
        assert (chain.num_queued - chain.num_taken > dropped) == stops
        blocks = llm.engine.block_manager
        assert not llm.engine.has_unfinished() and blocks.num_free_blocks == blocks.num_blocks
