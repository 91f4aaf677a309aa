"""Speculative decoding (orinfer/spec_decode/): n-gram drafts, the verify sampler, and the engine around them.

Greedy output must be token for token what the engine gives without speculation, whatever gets accepted; sampled
output must keep the model's distribution (a chi-square test on the verify sampler), and a seeded request must
repeat itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orinfer import LLM, SamplingParams
from orinfer.errors import ConfigError
from orinfer.layers.sampler import SamplingBatch
from orinfer.spec_decode.config import SpeculativeConfig
from orinfer.spec_decode.ngram import TokenArrays, ngram_draft
from orinfer.spec_decode.verify import DraftLayout, verify_drafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
PROMPTS = ["Alice was beginning to get very tired", "Down, down, down. Would the fall never", "The rabbit-hole went"]


# --- n-gram drafts ----------------------------------------------------------------------------------------------

def test_ngram_takes_the_longest_tail_at_its_latest_occurrence():
    tokens = np.array([1, 2, 3, 9, 5, 2, 3, 4, 7, 1, 2, 3])
    # [1 2 3] (n=3) occurs at 0: followed by 9 5 2; the shorter [2 3] would have matched later (at 5: 4 7 1).
    assert ngram_draft(tokens, 3, 1, 3) == [9, 5, 2]
    assert ngram_draft(tokens, 3, 1, 2) == [4, 7, 1]
    assert ngram_draft(tokens, 2, 3, 3) == [9, 5]


def test_ngram_without_a_match_or_context_drafts_nothing():
    assert ngram_draft(np.array([1, 2, 3, 4]), 3, 1, 3) == []
    assert ngram_draft(np.array([1, 2, 3, 4]), 3, 2, 3) == []
    assert ngram_draft(np.array([7]), 3, 1, 3) == []


def test_ngram_continues_a_repeating_pattern_past_the_end():
    assert ngram_draft(np.array([7, 8, 7, 8, 7, 8]), 5, 1, 3) == [7, 8, 7, 8, 7]
    assert ngram_draft(np.array([5, 5]), 4, 1, 3) == [5, 5, 5, 5]


def test_token_arrays_grow_with_the_list_and_restart_after_a_reset():
    arrays, tokens = TokenArrays(), [1, 2, 3]
    assert arrays.of(0, tokens).tolist() == [1, 2, 3]
    tokens += list(range(200))
    assert arrays.of(0, tokens).tolist() == tokens
    assert arrays.of(0, [4, 5]).tolist() == [4, 5]
    arrays.keep_only(set())
    assert arrays.of(0, [6]).tolist() == [6]


# --- the config ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "needs 'method' and 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min is larger"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown key(s) k"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "forced_acceptance": 1.5}, "forced_acceptance must be in"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_speculative_configs_are_named(value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(value)


def test_config_parses_json_text():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 4, 2)


# --- the verify sampler --------------------------------------------------------------------------------------------

def _sampling(rows: int, temperature: float, generator_rows: int = 0) -> SamplingBatch:
    batch = SamplingBatch(
        temperature=torch.full((rows,), temperature), top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows), min_p=torch.zeros(rows), repetition_penalty=torch.ones(rows),
        presence_penalty=torch.zeros(rows), frequency_penalty=torch.zeros(rows), history=None, output_ids=None,
        all_greedy=temperature == 0, use_top_k_top_p=False, use_min_p=False, use_repetition_penalty=False,
        use_presence_frequency=False)
    return batch


def test_greedy_verify_accepts_the_run_of_argmax_drafts_then_adds_the_next_argmax():
    vocab = 10
    # Sequence 0: 3 drafts, rows' argmax 4, 5, 6, 7 -> drafts [4, 5, 9] accept 2, then 6.
    # Sequence 1: no drafts, argmax 2. Sequence 2: 1 draft [3], argmax 3, 8 -> accept 1, then 8.
    argmax = [4, 5, 6, 7, 2, 3, 8]
    logits = torch.randn(len(argmax), vocab)
    logits[torch.arange(len(argmax)), argmax] = 10.0
    layout = DraftLayout([3, 0, 1], torch.tensor([[4, 5, 9], [0, 0, 0], [3, 0, 0]]))
    out = verify_drafts(logits, layout, SamplingBatch.greedy_only(), [None] * 3)
    assert out.num_accepted.tolist() == [2, 0, 1]
    assert out.token_ids.tolist() == [[4, 5, 6, -1], [2, -1, -1, -1], [3, 8, -1, -1]]


def test_forced_acceptance_accepts_at_the_given_rate():
    rows = 4000
    logits = torch.randn(2 * rows, 7)
    layout = DraftLayout([1] * rows, torch.randint(0, 7, (rows, 1)))
    out = verify_drafts(logits, layout, SamplingBatch.greedy_only(), [None] * rows, forced_acceptance=0.7)
    assert abs(out.num_accepted.float().mean().item() - 0.7) < 0.03
    everything = verify_drafts(logits, layout, SamplingBatch.greedy_only(), [None] * rows, forced_acceptance=1.0)
    assert everything.num_accepted.tolist() == [1] * rows


def _chi_square_p_value(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square test of observed counts against expected ones: the probability of a statistic at least
    this large if the counts follow the expectation (regularised upper incomplete gamma of df/2, stat/2)."""
    expected = expected * counts.sum() / expected.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_sampled_tokens_follow_the_target_distribution():
    """Each sequence drafts two tokens (a deterministic draft: the n-gram rule). Whatever is accepted, the first
    emitted token is distributed as row 0's p, and the second, given the first was the accepted draft, as row 1's."""
    torch.manual_seed(0)
    vocab, n = 6, 60000
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    p1 = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.20, 0.20])
    p2 = torch.full((vocab,), 1.0 / vocab)
    logits = torch.stack([p0.log(), p1.log(), p2.log()]).repeat(n, 1)
    drafts = torch.tensor([[1, 2]]).repeat(n, 1)
    out = verify_drafts(logits, DraftLayout([2] * n, drafts), _sampling(3 * n, 1.0), [None] * n)
    first = out.token_ids[:, 0]
    assert _chi_square_p_value(np.bincount(first.numpy(), minlength=vocab), (p0 * n).numpy()) > 1e-3
    after_draft = out.token_ids[first == 1, 1]
    m = after_draft.numel()
    assert _chi_square_p_value(np.bincount(after_draft.numpy(), minlength=vocab), (p1 * m).numpy()) > 1e-3
    # The acceptance rate of the first draft is p0(1).
    assert abs((first == 1).float().mean().item() - 0.25) < 0.01


def test_seeded_rows_repeat_their_draws():
    logits = torch.randn(6, 50)
    layout = DraftLayout([2, 2], torch.tensor([[3, 4], [5, 6]]))

    def run(seed: int):
        generators = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)]
        out = verify_drafts(logits, layout, _sampling(6, 0.8), generators)
        return out.token_ids.tolist(), out.num_accepted.tolist()

    assert run(3) == run(3)


# --- the engine ----------------------------------------------------------------------------------------------------

def _llm(tiny_dir, spec: dict | None, **kwargs) -> LLM:
    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False, speculative_config=spec, **kwargs)


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return _llm(tiny_dir, None)


@pytest.fixture(scope="module")
def ngram(tiny_dir):
    return _llm(tiny_dir, NGRAM)


def _seen(outs) -> list[tuple]:
    """What a caller sees, log-probability values aside (`_assert_same_logprobs` compares those)."""
    return [(o.token_ids, o.text, o.finish_reason, [(lp.token_id, [t for t, _ in lp.top]) for lp in o.logprobs])
            for o in outs]


def _assert_same_logprobs(got, want) -> None:
    """Log-probabilities agree to float32 noise: the verify step computes a row in a batch of other shapes."""
    for g, w in zip(got, want):
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)


def _generate(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    engine = llm.engine
    assert not engine.has_unfinished() and engine.in_flight is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outs


def test_greedy_output_is_unchanged_and_drafts_get_accepted(plain, ngram):
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    want = _generate(plain, PROMPTS, params)
    got = _generate(ngram, PROMPTS, params)
    assert _seen(got) == _seen(want)
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert drafted > 0 and 0 < accepted < drafted  # both outcomes happened
    assert all(o.metrics.mean_acceptance_length is None or o.metrics.mean_acceptance_length >= 1 for o in got)


def test_logprobs_and_penalties_match_plain_decoding(tiny_dir, plain, ngram):
    """The penalties of a verify row count the drafts before it as generated. The model drafting for itself accepts
    everything, so every row after the first depends on that; n-gram drafts rarely match under penalties."""
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, repetition_penalty=1.3,
                            frequency_penalty=0.2, ignore_eos=True)
    want = _generate(plain, PROMPTS, params)
    for llm in (ngram, _draft(tiny_dir, tiny_dir)):
        got = _generate(llm, PROMPTS, params)
        assert _seen(got) == _seen(want)
        _assert_same_logprobs(got, want)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0


def test_stop_token_and_stop_string_inside_an_accepted_run(plain, ngram):
    free = _generate(plain, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))[0]
    stop_id = free.token_ids[40]
    stop_text = free.text[len(free.text) // 2:][:6]
    for params in (SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[stop_id], ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=60, stop=[stop_text], ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)):
        want = _generate(plain, PROMPTS[0], params)
        got = _generate(ngram, PROMPTS[0], params)
        assert _seen(got) == _seen(want)
    assert len(got[0].token_ids) == 23


def test_seeded_sampling_repeats_and_stays_in_range(ngram):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=50, seed=11, ignore_eos=True)
    first = _generate(ngram, PROMPTS, params)
    again = _generate(ngram, PROMPTS, params)
    assert _seen(first) == _seen(again)
    assert all(len(o.token_ids) == 50 for o in first)


def test_preemption_and_lookahead_off_keep_greedy_output(tiny_dir, plain):
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    want = _generate(plain, PROMPTS, params)
    tight = _llm(tiny_dir, NGRAM, num_kv_blocks=14)
    got = _generate(tight, PROMPTS, params)
    assert _seen(got) == _seen(want)
    assert sum(o.metrics.num_preemptions for o in got) > 0
    no_lookahead = _llm(tiny_dir, NGRAM, async_scheduling=False)
    assert _seen(_generate(no_lookahead, PROMPTS, params)) == _seen(want)


def test_large_batches_do_not_speculate(tiny_dir, plain):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    small_batch = _llm(tiny_dir, dict(NGRAM, max_batch=2))
    got = _generate(small_batch, PROMPTS, params)
    assert _seen(got) == _seen(_generate(plain, PROMPTS, params))
    # Three sequences decode together until the first finishes: none of them drafts meanwhile.
    assert all(o.metrics.num_draft_tokens == 0 for o in got)


def test_proposals_that_find_nothing_back_off_and_keep_the_lookahead(tiny_dir, plain):
    """min_n = max_n = 6: the lookup rarely matches, so tries back off (1, 2, 4 ... steps) and the steps between them
    are launched as lookahead steps; the output stays plain decoding's."""
    rare = _llm(tiny_dir, dict(NGRAM, prompt_lookup_min=6, prompt_lookup_max=6))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    before = rare.engine.num_lookahead_steps
    got = _generate(rare, PROMPTS[2], params)
    assert _seen(got) == _seen(_generate(plain, PROMPTS[2], params))
    assert rare.engine.num_lookahead_steps - before >= 30


# --- draft model ---------------------------------------------------------------------------------------------------

def _draft(tiny_dir, model_dir, k: int = 3, **kwargs) -> LLM:
    return _llm(tiny_dir, {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}, **kwargs)


@pytest.fixture(scope="module")
def perturbed_dir(tiny_dir, tmp_path_factory):
    """The tiny model with noise on its MLPs: a draft that agrees with it often, not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed")
    for f in tiny_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if "mlp" in name:
            w += 0.5 * w.std() * torch.randn(w.shape, generator=gen)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_model_as_its_own_draft_accepts_everything(tiny_dir, plain):
    params = SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True)
    got = _generate(_draft(tiny_dir, tiny_dir), PROMPTS, params)
    assert _seen(got) == _seen(_generate(plain, PROMPTS, params))
    # 1 token from the prompt step, then 10 verify steps of 3 drafts + 1: all accepted (the last one's tokens end
    # the sequence, by length).
    assert [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in got] == [(30, 30)] * 3


def test_another_draft_model_keeps_greedy_output(tiny_dir, perturbed_dir, plain):
    params = SamplingParams(temperature=0.0, max_tokens=60, logprobs=2, ignore_eos=True)
    want = _generate(plain, PROMPTS, params)
    drafted = _draft(tiny_dir, perturbed_dir, k=4)
    got = _generate(drafted, PROMPTS, params)
    assert _seen(got) == _seen(want)
    _assert_same_logprobs(got, want)
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert 0 < accepted < sum(o.metrics.num_draft_tokens for o in got)
    tight = _draft(tiny_dir, perturbed_dir, k=4, num_kv_blocks=9)
    squeezed = _generate(tight, PROMPTS, params)
    assert _seen(squeezed) == _seen(want) and sum(o.metrics.num_preemptions for o in squeezed) > 0
    seeded = SamplingParams(temperature=1.0, max_tokens=40, seed=3, ignore_eos=True)
    assert _seen(_generate(drafted, PROMPTS, seeded)) == _seen(_generate(drafted, PROMPTS, seeded))


def test_draft_model_of_another_vocabulary_is_refused(tiny_dir, tmp_path):
    from hf_models import build_hf_model, save_hf_model

    save_hf_model(build_hf_model("qwen3-mha-tied", vocab_size=97), tmp_path)
    with pytest.raises(ConfigError, match="vocabulary"):
        _draft(tiny_dir, tmp_path)


def test_drafts_stay_on_the_device_unless_penalties_read_them(tiny_dir, perturbed_dir, plain):
    """A draft model's proposal reaches the verify step on the device (the host launches it without reading the
    drafts); under a penalty, which counts the drafts as generated, the host reads them first. Both give plain
    decoding's tokens."""
    llm = _draft(tiny_dir, perturbed_dir, k=4)
    proposer, host_reads = llm.engine.proposer, []
    propose = proposer.propose_batch

    def reading(seqs, rooms):
        host_reads.append(len(seqs))
        return propose(seqs, rooms)

    proposer.propose_batch = reading
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    got = _generate(llm, PROMPTS, params)
    assert _seen(got) == _seen(_generate(plain, PROMPTS, params))
    assert not host_reads and sum(o.metrics.num_accepted_tokens for o in got) > 0
    penalised = SamplingParams(temperature=0.0, max_tokens=30, presence_penalty=0.5, ignore_eos=True)
    got = _generate(llm, PROMPTS, penalised)
    assert _seen(got) == _seen(_generate(plain, PROMPTS, penalised))
    assert host_reads and sum(o.metrics.num_draft_tokens for o in got) > 0


def test_a_penalised_prompt_admitted_beside_device_drafts_keeps_plain_tokens(tiny_dir, perturbed_dir, plain):
    """Two slots: the third prompt, under a penalty, waits while the first two draft on the device, and is admitted
    into a verify step of the second (the sampler then builds every row's history, stand-in drafts included; only
    rows with a penalty read it, and those never carry device drafts). From then on proposals go through the host."""
    fast = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    slow = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True)
    params = [fast, slow, penalised]
    llm = _draft(tiny_dir, perturbed_dir, k=4, max_num_seqs=2)
    got = _generate(llm, PROMPTS, params)
    assert _seen(got) == _seen(_generate(plain, PROMPTS, params))
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
