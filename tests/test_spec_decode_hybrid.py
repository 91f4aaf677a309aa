"""Speculative decoding of hybrid targets (Qwen3.5 dense and MoE, tiny random models, fp32 CPU): the linear-attention
state is rolled back past rejected drafts (engine/state_rollback.py), so greedy tokens are plain decoding's and HF's,
with every acceptance length (drafts that spoil one token of the known answer), n-gram drafts, prompt chunks beside verify rows, prefix-cache hits
that resume a state snapshot, preemption, and a draft model."""

from __future__ import annotations

import pytest
import torch

from hf_models import build_hf_model, build_hf_qwen3_5, build_hf_qwen3_5_moe, hf_greedy, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.errors import ConfigError
from orinfer.spec_decode.config import SpeculativeConfig

PROMPTS = [[5, 17, 42, 99, 5, 17, 42, 99, 5, 17], [11, 200, 14, 11, 200], [7] * 9 + [1, 2, 3, 7, 7, 1, 2]]
STEPS = 40
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MODELS = {"dense": lambda: build_hf_qwen3_5("qwen3.5-interval4-untied"),
          "moe": lambda: build_hf_qwen3_5_moe("qwen3.5moe-e6-top2")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def target(request, tmp_path_factory):
    hf = MODELS[request.param]()
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return path, [hf_greedy(hf, prompt, STEPS) for prompt in PROMPTS]


def engine(path, spec=None, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=4, progress=False, speculative_config=spec,
               **settings)


def _generate(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert len(manager.free_state_slots) == manager.num_state_slots
    return outs


def _counts(outs) -> tuple[int, int]:
    return sum(o.metrics.num_draft_tokens for o in outs), sum(o.metrics.num_accepted_tokens for o in outs)


class OracleProposer:
    """Drafts the known greedy continuation with one token spoiled, at a place that cycles through 0 .. k (k: none
    spoiled), so verify steps accept every possible number of drafts and the state is rolled back by every amount."""

    def __init__(self, prompts: list[list[int]], want: list[list[int]]) -> None:
        self.want = {tuple(p): w for p, w in zip(prompts, want)}
        self.calls = 0

    def propose_batch(self, seqs, rooms):
        drafts = []
        for seq, room in zip(seqs, rooms):
            prompt = tuple(seq.token_ids[:seq.num_prompt_tokens])
            done = len(seq.token_ids) - seq.num_prompt_tokens
            draft = list(self.want[prompt][done:done + room])
            spoil = self.calls % (room + 1)
            if spoil < len(draft):
                draft[spoil] = (draft[spoil] + 1) % 211
            self.calls += 1
            drafts.append(draft)
        return drafts

    def keep_only(self, running) -> None:
        pass


def _oracle(llm: LLM, want) -> LLM:
    llm.engine.proposer = OracleProposer(PROMPTS, want)
    return llm


def test_every_acceptance_length_gives_hf_greedy_tokens(target):
    path, want = target
    outs = _generate(_oracle(engine(path, NGRAM), want))
    assert [o.token_ids for o in outs] == want
    drafted, accepted = _counts(outs)
    assert 0 < accepted < drafted  # drafts were both accepted and rejected: the state was rolled back


class _SkipsAfterSampled:
    """The engine's runner, except that the engine's `after_sampled` calls do nothing."""

    def __init__(self, runner) -> None:
        object.__setattr__(self, "_runner", runner)

    def after_sampled(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def __setattr__(self, name, value) -> None:
        setattr(self._runner, name, value)


def test_a_rollback_the_engine_left_due_runs_before_the_next_step(target):
    """The engine queues each verify step's rollback behind the tokens' host copies (`ModelRunner.after_sampled`);
    one never flushed there (an engine that failed in between) is run by the next `execute`, in step order."""
    path, want = target
    llm = _oracle(engine(path, NGRAM), want)
    runner = llm.engine.runner
    finishes = []
    finish = runner.rollback.finish
    runner.rollback.finish = lambda accepted: (finishes.append(1), finish(accepted))
    llm.engine.runner = _SkipsAfterSampled(runner)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert finishes  # every rollback came from execute's flush (the last one too: the states are released)


def test_ngram_speculation_gives_hf_greedy_tokens(target):
    path, want = target
    outs = _generate(engine(path, NGRAM))
    assert [o.token_ids for o in outs] == want
    assert _counts(outs)[0] > 0


@pytest.mark.parametrize("settings", [
    {"max_num_batched_tokens": 6},                       # prompt chunks beside verify rows
    {"num_kv_blocks": 14, "max_num_batched_tokens": 8},  # preemption: state slots freed, recomputed
    {"async_scheduling": False},
])
def test_speculation_under_chunks_preemption_and_no_lookahead(target, settings):
    path, want = target
    outs = _generate(_oracle(engine(path, NGRAM, **settings), want))
    assert [o.token_ids for o in outs] == want
    assert _counts(outs)[1] > 0
    if "num_kv_blocks" in settings:
        assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_prefix_cache_hits_resume_snapshots_under_speculation(target):
    path, want = target
    llm = _oracle(engine(path, NGRAM, max_num_seqs=4), want)
    assert [o.token_ids for o in _generate(llm)] == want
    again = _generate(llm)  # the same prompts: hits that restore the state snapshot at the last full block
    assert [o.token_ids for o in again] == want
    assert sum(o.num_cached_tokens for o in again) > 0


def test_a_draft_model_drafts_for_a_hybrid_target(target, tmp_path):
    path, want = target
    draft = save_hf_model(build_hf_model("qwen3-mha-tied", vocab_size=211), tmp_path / "draft")
    outs = _generate(engine(path, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}))
    assert [o.token_ids for o in outs] == want
    assert _counts(outs)[0] > 0


def test_seeded_sampling_repeats_under_speculation(target):
    path, want = target
    # (No prefix cache: a hit would change how the prompts are stepped, and a seeded request's draws follow which of
    # its steps verify drafts.)
    llm = engine(path, NGRAM, enable_prefix_caching=False)
    seeded = SamplingParams(temperature=0.8, max_tokens=20, seed=4, ignore_eos=True)
    first = _generate(_oracle(llm, want), params=seeded)
    again = _generate(_oracle(llm, want), params=seeded)  # the same drafts again: a fresh oracle
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 20 for o in first)


def test_the_rollback_comes_out_of_the_memory_budget(target):
    from orinfer.engine.state_rollback import StateRollback

    path, _ = target
    plain = engine(path, kv_cache_bytes=1 << 20).engine.runner
    spec = engine(path, dict(NGRAM, max_batch=3), kv_cache_bytes=1 << 20).engine.runner
    cfg = spec.model_config
    state = cfg.state_bytes_per_sequence(4)
    kept = StateRollback.buffer_bytes(cfg, 3, 3, torch.float32)
    assert spec.state.bytes == plain.state.bytes + 3 * state and kept > 0
    assert spec.num_blocks == ((1 << 20) - spec.state.bytes - kept) // spec.bytes_per_block()


def test_speculation_must_fit_what_the_engine_was_created_for(target):
    path, _ = target
    plain = engine(path)
    assert plain.engine.runner.rollback is None and plain.engine.runner.state.num_work_slots == 0
    with pytest.raises(ConfigError, match="created with speculative_config"):
        plain.engine.set_speculation(SpeculativeConfig.parse(NGRAM))
    llm = engine(path, dict(NGRAM, max_batch=2))
    assert llm.engine.runner.state.num_work_slots == 2
    with pytest.raises(ConfigError, match="exceed"):
        llm.engine.set_speculation(SpeculativeConfig.parse(dict(NGRAM, num_speculative_tokens=4)))
    llm.engine.set_speculation(None)
    assert [o.token_ids for o in _generate(llm)] == target[1]


def _triton_engine(path, spec: dict, **settings) -> LLM:
    """An fp32 engine on the triton op table (Triton's CPU interpreter without a GPU) with `spec`."""
    from orinfer.args import EngineArgs
    from orinfer.config import ModelConfig
    from orinfer.engine.llm_engine import EngineParts
    from orinfer.layers.triton_ops import triton_ops
    from orinfer.loader import load_hf_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig.from_hf(path)
    ops = triton_ops()
    net = load_hf_model(path, ops, torch.float32, torch.float32, device, cfg, progress=False)
    args = EngineArgs(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, speculative_config=spec, **settings)
    return LLM.from_parts(EngineParts(net, cfg, None, {}, device, torch.float32, ops=ops), args)


@pytest.mark.slow
def test_the_rollback_on_the_triton_kernels(target):
    """Through the triton op table: the fused step's row loop over the verify rows and the fused advance replaying
    1 + a accepted rows (runs shorter than the conv window among them): HF's tokens at every acceptance length."""
    path, want = target
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = _oracle(_triton_engine(path, NGRAM), want).generate(PROMPTS[:2], params)
    assert [o.token_ids for o in outs] == [w[:12] for w in want[:2]]
    assert 0 < _counts(outs)[1] < _counts(outs)[0]
