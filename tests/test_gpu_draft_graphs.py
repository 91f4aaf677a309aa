"""Draft-model proposals replayed from CUDA graphs (spec_decode/draft_graphs.py) on the triton backend, the trained tiny
Qwen3 (fp32) with a perturbed copy or itself drafting: greedy output with graph drafts is plain decoding's and the
eager drafts'; each graph proposal drafts what the eager proposer drafts and leaves the draft's KV cache as it
would; forced acceptance (0, partial, 1.0: the output then shows any draft that differs) gives the eager path's
tokens; batches past the largest bucket fall back to the eager path; preemption and prefix-cache hits keep the
output."""

from __future__ import annotations

import pytest
import torch

from orinfer import LLM, SamplingParams
from orinfer.engine.cuda_graph import batch_buckets
from orinfer.spec_decode.draft_graphs import capture_draft_graphs
from test_draft_graphs import PROMPTS, count_proposals, draft_both_ways
from test_spec_decode import perturbed_dir  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

K = 4
LENGTHS = [40, 17, 29]  # different lengths: the batch shrinks, so several buckets replay


def engine(tiny_dir, draft_dir, spec: dict | None = None, **settings) -> LLM:
    config = None if draft_dir is None else {"method": "draft_model", "model": str(draft_dir),
                                             "num_speculative_tokens": K, **(spec or {})}
    settings = {"kv_cache_bytes": 64 << 20, **settings}
    return LLM(tiny_dir, dtype="float32", device="cuda", backend="triton", progress=False, max_num_seqs=8,
               max_num_batched_tokens=64, speculative_config=config, **settings)


def params(batch: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in LENGTHS[:batch]]


def eager_drafts(llm: LLM) -> LLM:
    llm.engine.draft.graphs = None  # (the draft runner's decode graphs still replay the steps)
    return llm


def tokens(llm: LLM, batch: int, seed: int | None = None) -> list[list[int]]:
    if seed is not None:
        torch.manual_seed(seed)  # forced acceptance draws its uniforms from the global generator
    return [o.token_ids for o in llm.generate(PROMPTS[:batch], params(batch))]


def test_graphs_are_captured_per_bucket_only_with_graphs_on(tiny_dir, perturbed_dir):  # noqa: F811
    graphs = engine(tiny_dir, perturbed_dir).engine.draft.graphs
    assert graphs is not None and graphs.k == K
    assert graphs.buckets == batch_buckets(8)  # max_num_seqs 8 < 16
    # two graphs a bucket: a catch-up of one row per sequence (a decode step's shape) and of two
    assert sorted(graphs.graphs) == [(b, one_row) for b in graphs.buckets for one_row in (False, True)]
    assert engine(tiny_dir, perturbed_dir, cuda_graph=False).engine.draft.graphs is None


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_are_plain_decodings_and_the_eager_drafts(tiny_dir, perturbed_dir, batch):  # noqa: F811
    want = tokens(engine(tiny_dir, None), batch)
    llm = engine(tiny_dir, perturbed_dir)
    counts = count_proposals(llm.engine.draft)
    outs = llm.generate(PROMPTS[:batch], params(batch))
    assert [o.token_ids for o in outs] == want
    assert counts["graph"] > 0 and counts["eager"] == 0
    assert 0 < sum(o.metrics.num_accepted_tokens for o in outs) < sum(o.metrics.num_draft_tokens for o in outs)
    assert tokens(eager_drafts(engine(tiny_dir, perturbed_dir)), batch) == want


def test_the_model_as_its_own_draft_accepts_everything(tiny_dir):
    """Every verify step fully accepted: each graph catch-up runs the last draft and the newest token."""
    llm = engine(tiny_dir, tiny_dir)
    counts = count_proposals(llm.engine.draft)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True))
    want = engine(tiny_dir, None).generate(PROMPTS, SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    # 1 token from the prompt step, then 8 verify steps of 4 drafts + 1, all accepted.
    assert [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in outs] == [(32, 32)] * 3
    assert counts["graph"] == 8


def test_each_graph_proposal_drafts_and_caches_what_the_eager_one_does(tiny_dir, perturbed_dir):  # noqa: F811
    """Every proposal drafted both ways from the same state: the eager path leaves the draft's KV cache as the graph
    did (the same entries, within fp32 rounding of padded GEMMs and extend attention, and no others) and drafts the
    same tokens."""
    want = tokens(engine(tiny_dir, None), 3)
    llm = engine(tiny_dir, perturbed_dir)
    counts = count_proposals(llm.engine.draft)
    compared = draft_both_ways(llm, 1e-4)
    assert tokens(llm, 3) == want
    assert counts["graph"] >= 10
    assert all(got == expected for got, expected in compared)


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_forced_acceptance_gives_the_eager_drafts_tokens(tiny_dir, perturbed_dir, acceptance, batch):  # noqa: F811
    spec = {"forced_acceptance": acceptance}
    llm = engine(tiny_dir, perturbed_dir, spec)
    counts = count_proposals(llm.engine.draft)
    got = tokens(llm, batch, seed=0)
    assert counts["graph"] > 0
    assert tokens(eager_drafts(engine(tiny_dir, perturbed_dir, spec)), batch, seed=0) == got
    assert [len(t) for t in got] == LENGTHS[:batch]


def test_batches_past_the_largest_bucket_draft_eagerly(tiny_dir, perturbed_dir):  # noqa: F811
    spec = {"forced_acceptance": 1.0}  # every step keeps speculating
    llm = engine(tiny_dir, perturbed_dir, spec)
    llm.engine.draft.graphs.release()
    llm.engine.draft.graphs = capture_draft_graphs(llm.engine.draft.runner, K, 2)
    assert llm.engine.draft.graphs.buckets == [1, 2]
    counts = count_proposals(llm.engine.draft)
    got = tokens(llm, 3, seed=0)
    assert counts["graph"] > 0 and counts["eager"] > 0
    assert tokens(eager_drafts(engine(tiny_dir, perturbed_dir, spec)), 3, seed=0) == got


def test_preemption_and_prefix_cache_hits_keep_greedy_output(tiny_dir, perturbed_dir):  # noqa: F811
    want = tokens(engine(tiny_dir, None), 3)
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)  # 3 x 50 tokens outgrow 9 blocks
    want_long = [o.token_ids for o in engine(tiny_dir, None).generate(PROMPTS, long)]
    tight = engine(tiny_dir, perturbed_dir, kv_cache_bytes=None, num_kv_blocks=9)
    counts = count_proposals(tight.engine.draft)
    outs = tight.generate(PROMPTS, long)
    assert [o.token_ids for o in outs] == want_long
    assert sum(o.metrics.num_preemptions for o in outs) > 0 and counts["graph"] > 0
    llm = engine(tiny_dir, perturbed_dir, block_size=4)  # (small blocks: the short prompts fill some)
    counts = count_proposals(llm.engine.draft)
    assert tokens(llm, 1) == want[:1]
    outs = llm.generate(PROMPTS[:2], params(2))  # the first prompt again: a prefix-cache hit
    assert [o.token_ids for o in outs] == want[:2]
    assert outs[0].num_cached_tokens > 0 and counts["graph"] > 0
