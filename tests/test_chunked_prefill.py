"""Token-budget scheduling through the whole engine (tiny random Qwen3, fp32 CPU): prompts split into chunks of any
budget, steps that mix decode rows with prompt chunks, preemption, lookahead and prefix-cache hits give the greedy
tokens of HF transformers and of an engine that neither chunks nor caches."""

from __future__ import annotations

import pytest
import torch

from hf_models import build_hf_model, hf_greedy, save_hf_model
from orinfer import LLM, SamplingParams
from orinfer.engine.scheduler import StepPlan

BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SYSTEM = [5, 17, 42, 99, 3, 150, 7, 8, 61, 23, 9, 14, 33]   # 13 tokens: the shared head of the prompts below
PROMPTS = [SYSTEM + [11, 12], [200, 201, 202], SYSTEM + list(range(40, 63)), SYSTEM[:8] + [9]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = build_hf_model("qwen3-gqa4-untied")
    path = save_hf_model(hf, tmp_path_factory.mktemp("chunked"))
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    return hf, path, want


def engine(path, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=BLOCK, progress=False, **settings)


@pytest.mark.pairwise
@pytest.mark.parametrize("budget", [1, 3, 4, 7, 16, 64])
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_any_chunk_budget_gives_hf_tokens(model, budget, async_scheduling, prefix_caching):
    _, path, want = model
    llm = engine(path, max_num_batched_tokens=budget, async_scheduling=async_scheduling,
                 enable_prefix_caching=prefix_caching)
    for _ in range(2):  # the second round hits the cache the first filled
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_steps_mix_decode_rows_and_prompt_chunks(model):
    """A prompt arriving while others decode is computed in chunks beside their decode rows, in steps launched behind
    the one before (lookahead: the arrival joins them without a drain); every stream keeps getting a token each step,
    and all tokens match HF."""
    hf, path, _ = model
    llm = engine(path, max_num_batched_tokens=6)
    plans: list[tuple[int, int]] = []   # per step: (decode rows, prompt tokens)
    real_schedule = llm.engine.scheduler.schedule

    def schedule() -> StepPlan:
        plan = real_schedule()
        rows = sum(1 for s in plan.seqs if s.is_decoding)
        plans.append((rows, plan.num_tokens - rows))
        return plan

    llm.engine.scheduler.schedule = schedule
    real_lookahead = llm.engine.scheduler.plan_lookahead
    lookahead_chunks = []   # prompt tokens of each step launched behind another

    def plan_lookahead(batch) -> StepPlan | None:
        plan = real_lookahead(batch)
        if plan is not None:
            lookahead_chunks.append(plan.num_tokens - len(batch))
            plans.append((len(batch), plan.num_tokens - len(batch)))
        return plan

    llm.engine.scheduler.plan_lookahead = plan_lookahead
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    early = [llm.engine.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(4):
        llm.engine.step()
    late = llm.engine.add_request(PROMPTS[2], params)   # 36 tokens: six chunks of the budget
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert any(rows == 2 and prompt > 0 for rows, prompt in plans)
    assert any(lookahead_chunks)           # chunks also ran in steps launched behind the one before
    assert all(rows + prompt <= 6 for rows, prompt in plans)
    for seq, prompt in zip(early + [late], PROMPTS[:3]):
        assert seq.completion_token_ids == hf_greedy(hf, prompt, 20)


def test_preemption_while_prompts_are_chunked(model):
    """A pool too small for everything: sequences are preempted (some inside their prompt) and recomputed; tokens as
    an engine with room for all of them."""
    _, path, _ = model
    prompts = [SYSTEM + [i, i + 1, i + 2] for i in range(40, 46)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    small = engine(path, num_kv_blocks=14, max_num_batched_tokens=5)
    got = small.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in got) > 0
    want = engine(path, enable_prefix_caching=False, enable_chunked_prefill=False).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert small.engine.block_manager.num_free_blocks == 14


def test_identical_prompts_in_one_step_share_blocks_with_seeds_and_logprobs_unchanged(model):
    """The choices of an n > 1 request: sampled with their own seeds, the second reuses the prompt blocks the first
    computes in the same step; tokens and log-probabilities as without the cache."""
    _, path, _ = model
    prompt = SYSTEM + [77, 78]
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=seed, logprobs=2) for seed in (1, 2)]
    got = engine(path).generate([prompt, prompt], params)
    want = engine(path, enable_prefix_caching=False).generate([prompt, prompt], params)
    assert [o.num_cached_tokens for o in got] == [0, 12]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        torch.testing.assert_close([lp.logprob for lp in a.logprobs], [lp.logprob for lp in b.logprobs])


def test_chunking_off_runs_a_long_prompt_whole(model):
    _, path, want = model
    llm = engine(path, max_num_batched_tokens=8, enable_chunked_prefill=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
