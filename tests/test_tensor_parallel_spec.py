"""Speculative decoding of hybrid Qwen3.5 targets (dense and MoE) under tensor parallelism, on the CPU: 2 (and 4) gloo
processes must give the greedy tokens of the single-process engine, with and without speculation (and HF's).

Each rank rolls its own shard of the linear-attention state back past rejected drafts (engine/state_rollback.py:
rank 0 hands the work-slot copies and the state advance to the workers, distributed/mirror.py); the n-gram and
spoiling-oracle proposers run on rank 0, the draft model whole on rank 0, the MTP head split over the ranks like the
decoder (its fc by input columns). The oracle spoils one draft at a place that cycles through every position, so every
acceptance length and every rollback amount occurs; its engine also runs prompt chunks beside verify rows and a second
round whose prompts hit the prefix cache and resume state snapshots."""

from __future__ import annotations

import pytest

from hf_models import build_hf_model, build_hf_qwen3_5, build_hf_qwen3_5_moe, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.spec_decode.config import SpeculativeConfig
from orinfer.spec_decode.verify import host_drafts
from test_qwen3_5 import _with_mtp
from test_spec_decode_hybrid import NGRAM, PROMPTS, OracleProposer

SLOW = pytest.mark.slow
STEPS = 24
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
SETTINGS = dict(device="cpu", dtype="float32", progress=False, block_size=4, num_kv_blocks=96, max_num_seqs=4)
# The MoE target's seed 1: its greedy continuations repeat context tokens, so the n-gram round below has drafts to
# verify (seed 0's, since its shared expert has the experts' width, give the proposer no match).
MODELS = {"dense": lambda: build_hf_qwen3_5("qwen3.5-interval4-untied"),
          "moe": lambda: build_hf_qwen3_5_moe("qwen3.5moe-e6-top2", seed=1)}
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """kind -> (checkpoint with a random MTP head, the single-process engine's greedy tokens without speculation)."""
    made = {}

    def get(kind: str):
        if kind not in made:
            plain = save_hf_model(MODELS[kind](), tmp_path_factory.mktemp(kind))
            path = _with_mtp(plain, tmp_path_factory.mktemp(kind + "_mtp"))
            with LLM(path, **SETTINGS) as llm:
                made[kind] = path, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        return made[kind]

    return get


def _counts(outs) -> tuple[int, int]:
    return sum(o.metrics.num_draft_tokens for o in outs), sum(o.metrics.num_accepted_tokens for o in outs)


def _recording(llm: LLM) -> list[list[list[int]]]:
    """The drafts of each proposal that `llm`'s proposer makes from now on (a list it fills). A proposer that can
    leave its drafts on the device makes every proposal there (one process leaves them there; tensor parallelism reads
    them through `propose_batch`, which calls it): its drafts are read back for the record."""
    proposer, made = llm.engine.proposer, []
    if not hasattr(proposer, "propose_on_device"):
        propose = proposer.propose_batch

        def recorded(seqs, rooms):
            drafts = propose(seqs, rooms)
            made.append(drafts)
            return drafts

        proposer.propose_batch = recorded
        return made
    propose_on_device = proposer.propose_on_device

    def recorded_on_device(seqs, rooms):
        proposal = propose_on_device(seqs, rooms)
        made.append(host_drafts(proposal, seqs))
        return proposal

    proposer.propose_on_device = recorded_on_device
    return made


def _oracle_rounds(llm: LLM, want: list[list[int]]) -> list:
    """Two rounds of the prompts with the spoiling oracle (the second hits the prefix cache), then one with the
    n-gram proposer; every block and state slot is free after each."""
    engine, outs = llm.engine, []
    for _ in range(2):
        engine.proposer = OracleProposer(PROMPTS, want)
        outs.append(llm.generate(PROMPTS, GREEDY))
    engine.set_speculation(SpeculativeConfig.parse(NGRAM))
    outs.append(llm.generate(PROMPTS, GREEDY))
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert len(manager.free_state_slots) == manager.num_state_slots
    return outs


@pytest.mark.parametrize("kind,world", [("dense", 2), pytest.param("moe", 2, marks=SLOW),
                                        pytest.param("dense", 4, marks=SLOW), pytest.param("moe", 4, marks=SLOW)])
def test_every_acceptance_length_chunks_prefix_hits_and_ngram(targets, kind, world):
    """Prompt chunks of 6 tokens beside verify rows; blocks of 4 with snapshots, so the second round resumes states
    saved by the first."""
    path, want = targets(kind)
    settings = dict(SETTINGS, max_num_batched_tokens=6, num_state_snapshots=8, speculative_config=NGRAM)
    with LLM(path, tensor_parallel_size=world, **settings) as llm:
        oracle, again, ngram = _oracle_rounds(llm, want)
    for outs in (oracle, again, ngram):
        assert [o.token_ids for o in outs] == want
    for outs in (oracle, again):
        drafted, accepted = _counts(outs)
        assert 0 < accepted < drafted  # accepted and rejected drafts: each rank's state was rolled back
    assert sum(o.num_cached_tokens for o in again) > 0
    assert _counts(ngram)[0] > 0  # n-gram drafts were verified (random weights: few are right)


@pytest.mark.parametrize("kind,world", [("dense", 2), pytest.param("moe", 2, marks=SLOW),
                                        pytest.param("dense", 4, marks=SLOW)])
def test_mtp_head_split_over_the_ranks(targets, kind, world):
    """The MTP head's layer and fc are split like the decoder's layers. Its drafts leave the tokens plain decoding's,
    and they are the single process's drafts (the same head whole), proposal by proposal: the tokens alone would not
    tell a head that ran wrong on the ranks (verification keeps them exact whatever is drafted)."""
    path, want = targets(kind)
    with LLM(path, speculative_config=MTP, **SETTINGS) as one:
        drafts_alone = _recording(one)
        alone = one.generate(PROMPTS, GREEDY)
    with LLM(path, tensor_parallel_size=world, speculative_config=MTP, **SETTINGS) as llm:
        fc = llm.engine.parts.model.mtp.fc.weight
        assert fc.shape[1] * world == 2 * fc.shape[0]  # this rank's input columns of fc
        drafts = _recording(llm)
        got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in alone] == want
    assert [o.token_ids for o in got] == want
    assert drafts == drafts_alone and any(any(d) for d in drafts)


@pytest.mark.parametrize("kind", [pytest.param("dense", marks=SLOW), pytest.param("moe", marks=SLOW)])
def test_draft_model_whole_on_rank_0_for_a_split_hybrid_target(targets, kind, tmp_path):
    """A plain Qwen3 draft (its vocabulary the target's) kept whole on rank 0, without collectives, beside a split
    hybrid target whose verify steps roll back on every rank."""
    path, want = targets(kind)
    draft = save_hf_model(build_hf_model("qwen3-mha-tied", vocab_size=211), tmp_path / "draft")
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with LLM(path, speculative_config=spec, **SETTINGS) as one:
        alone = one.generate(PROMPTS, GREEDY)
    with LLM(path, tensor_parallel_size=2, speculative_config=spec, **SETTINGS) as llm:
        got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in alone] == want
    assert [o.token_ids for o in got] == want
    assert [_counts([o]) for o in got] == [_counts([o]) for o in alone] and _counts(got)[0] > 0
