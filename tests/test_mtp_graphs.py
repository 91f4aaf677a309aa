"""The MTP draft graphs' host side (spec_decode/mtp_graphs.py): bucket choice, the padded input layout, and the padded
proposal itself run eagerly on the CPU (the work the graphs capture, on the torch backend, fp32) against the eager
proposer. The captured replay is checked on the GPU in test_gpu_mtp_graphs.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_models import hf_greedy, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.spec_decode.mtp import MTPProposer, mtp_head
from orinfer.spec_decode.mtp_graphs import MTPGraphs
from orinfer.spec_decode.proposal_graphs import InputLayout, fill_inputs, pick_bucket
from test_qwen3_5 import _with_mtp
from test_spec_decode_hybrid import MODELS

PROMPTS = [[5, 17, 42, 99, 5, 17, 42, 99, 5, 17], [11, 200, 14], [7] * 9 + [1, 2, 3, 7, 7, 1, 2]]
STEPS = 20
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def test_pick_bucket_takes_the_smallest_that_holds_sequences_and_rows():
    buckets = [1, 2, 4, 8, 16]  # 4 rows a sequence: k + 1 for k = 3
    assert pick_bucket(buckets, 4, 1, 1) == 1
    assert pick_bucket(buckets, 4, 1, 4) == 1       # k + 1 rows: a fully accepted verify step
    assert pick_bucket(buckets, 4, 1, 5) == 2       # a longer catch-up takes a larger bucket, not the eager path
    assert pick_bucket(buckets, 4, 3, 3) == 4
    assert pick_bucket(buckets, 4, 3, 17) == 8
    assert pick_bucket(buckets, 4, 16, 64) == 16
    assert pick_bucket(buckets, 4, 16, 65) is None  # a whole prompt's catch-up: eager
    assert pick_bucket(buckets, 4, 17, 17) is None  # more sequences than the largest bucket: eager
    assert pick_bucket([1, 2], 2, 2, 4) == 2 and pick_bucket([1, 2], 2, 2, 5) is None


@pytest.mark.parametrize("k", [1, 3])
def test_layout_fields_are_disjoint_aligned_and_tables_last(k):
    layout = InputLayout(max_batch=4, k=k, max_blocks=5, rows_per_seq=k + 1)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(buffer)
    seen = np.zeros(layout.nbytes, dtype=np.int32)
    for name, view in views.items():
        start = view.storage_offset() * view.element_size()
        assert start % view.element_size() == 0, name
        seen[start:start + view.numel() * view.element_size()] += 1
    assert (seen == 1).all()  # every byte belongs to exactly one field
    assert views["ids"].shape == (16 if k == 3 else 8,) and views["step_slots"].shape == (k - 1, 4)
    assert views["block_tables"].shape == (4, 5) and views["block_tables"].dtype == torch.int32
    tables_end = views["block_tables"].storage_offset() * 4 + 4 * 5 * 4
    assert tables_end == layout.nbytes == layout.used_bytes(4)
    assert layout.used_bytes(1) == layout.nbytes - 3 * 5 * 4  # a bucket uploads only its table rows


def test_fill_inputs_packs_rows_and_pads_rows_sequences_and_steps():
    layout = InputLayout(max_batch=4, k=3, max_blocks=3, rows_per_seq=4)
    host = {name: view.numpy() for name, view in layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8)).items()}
    host["ids"][:] = 77  # stale values of an earlier proposal: every field the bucket reads is rewritten
    host["block_tables"][:] = 9
    # Sequence 0: newest token index 6, catches up on positions 4, 5 (tokens x5, x6); blocks [3, 1] of 4 tokens.
    # Sequence 1: newest index 2, positions 0, 1 (a short prompt); block [2].
    rows = fill_inputs(host, 4, 3, [[3, 1], [2]], [[50, 60], [21, 22]], [4, 0], block_size=4)
    assert rows == 4
    assert host["ids"].tolist() == [50, 60, 21, 22] + [0] * 12
    assert host["positions"].tolist() == [4, 5, 0, 1] + [0] * 12
    assert host["slots"].tolist() == [1 * 4 + 0, 1 * 4 + 1, 2 * 4 + 0, 2 * 4 + 1] + [-1] * 12
    assert host["query_start_loc"].tolist() == [0, 2, 4, 4, 4]
    assert host["context_lens"].tolist() == [6, 2, 0, 0]
    assert host["sample_rows"].tolist() == [1, 3, 0, 0]
    # Draft steps 1 and 2: positions N and N + 1 of each sequence; padding rows store nothing over block 0.
    assert host["step_positions"].tolist() == [[6, 2, 0, 0], [7, 3, 0, 0]]
    assert host["step_slots"].tolist() == [[1 * 4 + 2, 2 * 4 + 2, -1, -1], [1 * 4 + 3, 2 * 4 + 3, -1, -1]]
    assert host["step_context_lens"].tolist() == [[7, 3, 1, 1], [8, 4, 1, 1]]
    assert host["block_tables"][:2, :2].tolist() == [[3, 1], [2, 9]]  # entries past a table are never read
    assert host["block_tables"][2:, 0].tolist() == [0, 0]


def test_bucket_for_sends_overwide_tables_to_the_eager_path():
    graphs = MTPGraphs.__new__(MTPGraphs)
    graphs.buckets, graphs.k, graphs.max_blocks, graphs.rows_per_seq = [1, 2], 3, 8, 4
    assert graphs.bucket_for(2, 5, 8) == 2
    assert graphs.bucket_for(2, 5, 9) is None
    assert graphs.bucket_for(3, 3, 1) is None


# --- the padded proposal on the CPU -----------------------------------------------------------------------------------

def mtp_target(name: str, tmp_path_factory, prompts: list[list[int]], steps: int):
    """(a tiny Qwen3.5 checkpoint `name` of test_spec_decode_hybrid.MODELS with a random MTP head, HF's greedy
    tokens after each prompt)."""
    hf = MODELS[name]()
    path = _with_mtp(save_hf_model(hf, tmp_path_factory.mktemp(name)), tmp_path_factory.mktemp(name + "_mtp"))
    return path, [hf_greedy(hf, prompt, steps) for prompt in prompts]


@pytest.fixture(scope="module", params=sorted(MODELS))
def target(request, tmp_path_factory):
    return mtp_target(request.param, tmp_path_factory, PROMPTS, STEPS)


def engine(path, spec, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=4, progress=False, speculative_config=spec,
               **settings)


def count_proposals(mtp: MTPProposer) -> dict[str, int]:
    """Counts `mtp`'s proposals that go through its graphs ("graph") and that run eagerly ("eager"); `mtp` may also be
    a DraftModelProposer (the same `graphs.run` and `_draft_eager`)."""
    counts = {"graph": 0, "eager": 0}
    run, eager = mtp.graphs.run, mtp._draft_eager

    def counted_run(*args, **kwargs):
        counts["graph"] += 1
        return run(*args, **kwargs)

    def counted_eager(*args):
        counts["eager"] += 1
        return eager(*args)

    mtp.graphs.run, mtp._draft_eager = counted_run, counted_eager
    return counts


def draft_both_ways(llm: LLM, tolerance: float) -> list[tuple[list, list]]:
    """Has every proposal of `llm` drafted by the graphs first, then eagerly: the eager proposer must find nothing
    to change in the head's KV cache (the same entries at the same positions, within `tolerance`, and none elsewhere:
    padding rows store nothing). Returns the (graph, eager) drafts of each proposal, filled as `llm` runs. (The cache
    is the sharp check: a tiny random head's argmax barely depends on its attention.)"""
    mtp = llm.engine.mtp
    caches = [cache for attn in mtp_head(llm.engine.runner.model).attention_layers()
              for cache in (attn.k_cache, attn.v_cache)]
    draft = mtp._draft
    compared = []

    def both(seqs, feeds, firsts, hiddens):
        got = draft(seqs, feeds, firsts, hiddens).clone()
        after_graph = [cache.clone() for cache in caches]
        expected = mtp._draft_eager(seqs, feeds, firsts, torch.cat(hiddens))
        record_comparison(compared, caches, after_graph, got, expected, tolerance)
        return got

    mtp._draft = both
    return compared


def record_comparison(compared: list, caches: list[torch.Tensor], after_graph: list[torch.Tensor], got: torch.Tensor,
                      expected: torch.Tensor, tolerance: float) -> None:
    """The draft's KV caches left by the graph path (`after_graph`) equal the eager path's (`caches`, as it left
    them); the (graph, eager) drafts of the proposal go to `compared`."""
    for cache, graph_cache in zip(caches, after_graph):
        torch.testing.assert_close(graph_cache, cache, rtol=tolerance, atol=tolerance)
    compared.append((got.tolist(), expected.tolist()))


def padded(llm: LLM, max_batch: int = 16) -> dict[str, int]:
    """Gives `llm`'s MTP proposer uncaptured MTP graphs (their padded work run eagerly, on the CPU); returns
    `count_proposals`' counters."""
    runner, mtp = llm.engine.runner, llm.engine.mtp
    assert mtp.graphs is None  # the CPU never captures
    mtp.graphs = MTPGraphs(runner.model, mtp.k, max_batch, -(-runner.max_model_len // runner.block_size),
                           runner.block_size, runner.model_config.hidden_size, runner.kv_dtype, runner.device)
    return count_proposals(mtp)


def test_padded_proposals_give_the_eager_drafts_and_head_cache(target):
    path, want = target
    llm = engine(path, MTP)
    counts = padded(llm)
    compared = draft_both_ways(llm, 1e-5)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert counts["graph"] >= 3  # (random weights: few drafts are accepted, so speculation pauses often)
    assert len(compared) >= 3 and all(got == expected for got, expected in compared)


def test_padded_proposals_in_batches_of_one_and_three_and_past_the_largest_bucket(target):
    path, want = target
    single = engine(path, MTP)
    counts = padded(single)
    assert single.generate(PROMPTS[:1], GREEDY)[0].token_ids == want[0]
    assert counts["graph"] > 0
    # Largest bucket 2: while three sequences decode they draft eagerly, then the graphs' work takes over.
    lengths = [STEPS, 6, 11]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    llm = engine(path, MTP)
    counts = padded(llm, max_batch=2)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [w[:n] for w, n in zip(want, lengths)]
    assert counts["graph"] > 0 and counts["eager"] > 0


def test_forced_acceptance_gives_the_eager_paths_tokens(target):
    """Forced acceptance takes every draft: the output is the drafts themselves, so it shows any draft that differs."""
    path, _ = target
    spec = dict(MTP, forced_acceptance=1.0)
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    eager = [o.token_ids for o in engine(path, spec).generate(PROMPTS, params)]
    llm = engine(path, spec)
    counts = padded(llm)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == eager
    assert counts["graph"] > 0
    assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0 for o in outs)
