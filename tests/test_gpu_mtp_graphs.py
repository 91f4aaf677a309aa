"""MTP drafts replayed from CUDA graphs (spec_decode/mtp_graphs.py) on the triton backend, tiny Qwen3.5 dense and MoE
targets with an MTP head, fp32: greedy output with graph drafts is HF's, plain decoding's and the eager drafts';
each graph proposal drafts what the eager proposer drafts and leaves the head's KV cache as it would; forced
acceptance (whose output is the drafts themselves) gives the eager path's tokens; batches past the largest bucket
and catch-ups past a bucket's rows fall back to the eager path."""

from __future__ import annotations

import pytest
import torch

from orinfer import LLM, SamplingParams
from orinfer.engine.cuda_graph import batch_buckets
from orinfer.spec_decode.mtp_graphs import capture_mtp_graphs
from test_mtp_graphs import count_proposals, draft_both_ways, mtp_target
from test_spec_decode_hybrid import MODELS, PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 40
LENGTHS = [STEPS, 17, 29]  # different lengths: the batch shrinks, so several buckets replay
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module", params=sorted(MODELS))
def target(request, tmp_path_factory):
    return mtp_target(request.param, tmp_path_factory, PROMPTS, STEPS)


def engine(path, spec: dict | None, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cuda", backend="triton", block_size=16, kv_cache_bytes=64 << 20,
               max_num_seqs=8, max_num_batched_tokens=32, progress=False, speculative_config=spec, **settings)


def params(batch: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in LENGTHS[:batch]]


def counted(llm: LLM) -> dict[str, int]:
    return count_proposals(llm.engine.mtp)


def eager_drafts(llm: LLM) -> LLM:
    llm.engine.mtp.graphs = None
    return llm


def tokens(llm: LLM, batch: int, seed: int | None = None) -> list[list[int]]:
    if seed is not None:
        torch.manual_seed(seed)  # forced acceptance draws its uniforms from the global generator
    return [o.token_ids for o in llm.generate(PROMPTS[:batch], params(batch))]


def test_graphs_are_captured_per_bucket_only_with_graphs_on(target):
    path, _ = target
    graphs = engine(path, MTP).engine.mtp.graphs
    assert graphs is not None and graphs.k == 3
    assert graphs.buckets == batch_buckets(8) and sorted(graphs.graphs) == graphs.buckets  # max_num_seqs 8 < 16
    assert engine(path, MTP, cuda_graph=False).engine.mtp.graphs is None


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_are_plain_decodings_and_the_eager_drafts(target, batch):
    path, want = target
    llm = engine(path, MTP)
    counts = counted(llm)
    got = tokens(llm, batch)
    assert got == [w[:n] for w, n in zip(want, LENGTHS[:batch])]
    assert counts["graph"] > 0
    assert tokens(engine(path, None), batch) == got
    assert tokens(eager_drafts(engine(path, MTP)), batch) == got


def test_each_graph_proposal_drafts_and_caches_what_the_eager_one_does(target):
    """Every proposal drafted both ways, the graph first: the eager proposer then rewrites the head's KV entries with
    the same values (and no others: padding rows store nothing) and drafts the same tokens."""
    path, want = target
    llm = engine(path, MTP)
    counts = counted(llm)
    compared = draft_both_ways(llm, 1e-4)  # (fp32: the graph's padded GEMMs and extend attention round differently)
    assert tokens(llm, 3) == [w[:n] for w, n in zip(want, LENGTHS)]
    assert counts["graph"] >= 3
    assert all(got == expected for got, expected in compared)


@pytest.mark.parametrize("acceptance", [1.0, 0.5])
@pytest.mark.parametrize("batch", [1, 3])
def test_forced_acceptance_gives_the_eager_drafts_tokens(target, acceptance, batch):
    """Forced acceptance emits accepted drafts whatever the target says: equal tokens mean equal drafts."""
    path, _ = target
    spec = dict(MTP, forced_acceptance=acceptance)
    llm = engine(path, spec)
    counts = counted(llm)
    got = tokens(llm, batch, seed=0)
    assert counts["graph"] > 0
    assert tokens(eager_drafts(engine(path, spec)), batch, seed=0) == got
    assert [len(t) for t in got] == LENGTHS[:batch]


def test_batches_and_catch_ups_past_the_largest_bucket_run_eagerly(target):
    """Forced acceptance 1.0 keeps every step speculating: a random head's drafts are mostly rejected, and steps that
    accept nothing back off, which left no proposal for the graphs once the batch shrank (run 309)."""
    path, _ = target
    spec = dict(MTP, forced_acceptance=1.0)
    llm = engine(path, spec, enable_prefix_caching=False)  # the second prompt's catch-up starts at its first token
    llm.engine.mtp.graphs.release()
    # Buckets of 1 and 2 sequences (4 and 8 catch-up rows): three decoding sequences, and the first catch-up over a
    # whole prompt of 10 or 16 tokens, draft eagerly; the rest replay.
    llm.engine.mtp.graphs = capture_mtp_graphs(llm.engine.runner, 3, 2)
    assert llm.engine.mtp.graphs.buckets == [1, 2]
    counts = counted(llm)
    got = tokens(llm, 3, seed=0)
    assert counts["graph"] > 0 and counts["eager"] > 0
    assert tokens(eager_drafts(engine(path, spec, enable_prefix_caching=False)), 3, seed=0) == got
    counts["graph"] = counts["eager"] = 0
    torch.manual_seed(1)
    single = [o.token_ids for o in llm.generate([PROMPTS[2]], params(1))]
    assert counts["eager"] >= 1 and counts["graph"] > 0  # the 15-row first catch-up, then graph proposals
    torch.manual_seed(1)
    eager = eager_drafts(engine(path, spec, enable_prefix_caching=False))
    assert [o.token_ids for o in eager.generate([PROMPTS[2]], params(1))] == single
