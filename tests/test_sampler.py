"""The sampler against the definitions of each filter (and HF's repetition-penalty processor)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from orinfer.layers.sampler import SamplingBatch, apply_penalties, sample


def batch_of(rows: int, **overrides) -> SamplingBatch:
    fields = dict(temperature=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.int64), top_p=torch.ones(rows),
                  min_p=torch.zeros(rows), repetition_penalty=torch.ones(rows), presence_penalty=torch.zeros(rows),
                  frequency_penalty=torch.zeros(rows), history=None, output_ids=None)
    fields.update(overrides)
    return SamplingBatch(**fields)


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def draw_many(n: int, **overrides) -> torch.Tensor:
    logits = PROBS.log().repeat(n, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    return sample(logits, batch_of(n, generators=gens, **overrides)).token_ids


def frequencies(ids: torch.Tensor) -> torch.Tensor:
    return torch.bincount(ids, minlength=4).float() / len(ids)


def test_plain_sampling_follows_softmax():
    freq = frequencies(draw_many(6000))
    torch.testing.assert_close(freq, PROBS, atol=0.025, rtol=0)


def test_temperature_sharpens():
    freq = frequencies(draw_many(6000, temperature=torch.full((6000,), 0.5)))
    expected = torch.softmax(PROBS.log() / 0.5, dim=0)
    torch.testing.assert_close(freq, expected, atol=0.025, rtol=0)


def test_top_k_top_p_min_p_restrict_support():
    n = 3000
    assert set(draw_many(n, top_k=torch.full((n,), 2)).tolist()) == {0, 1}
    # top_p 0.7: token 0 (0.5) is kept, token 1 is needed to reach 0.7, token 2 is not.
    assert set(draw_many(n, top_p=torch.full((n,), 0.7)).tolist()) == {0, 1}
    # min_p 0.5: keep tokens with p >= 0.25.
    assert set(draw_many(n, min_p=torch.full((n,), 0.5)).tolist()) == {0, 1}
    freq = frequencies(draw_many(n, top_k=torch.full((n,), 2)))
    torch.testing.assert_close(freq[:2], torch.tensor([0.625, 0.375]), atol=0.03, rtol=0)


def test_greedy_rows_take_argmax_and_seeded_rows_are_reproducible():
    logits = torch.randn(3, 50)
    temps = torch.tensor([0.0, 1.0, 1.0])
    gens = [None, torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)]
    ids = sample(logits, batch_of(3, temperature=temps, generators=gens)).token_ids
    assert ids[0] == logits[0].argmax()
    again = sample(logits, batch_of(3, temperature=temps,
                                    generators=[None, torch.Generator().manual_seed(5), None])).token_ids
    assert ids[1] == again[1]


def test_repetition_penalty_matches_hf():
    transformers = pytest.importorskip("transformers")
    logits = torch.randn(2, 30)
    history = torch.tensor([[1, 4, 4, 9], [2, 3, -1, -1]])
    ours = apply_penalties(logits, batch_of(2, repetition_penalty=torch.tensor([1.3, 1.3]), history=history))
    proc = transformers.RepetitionPenaltyLogitsProcessor(1.3)
    expected = torch.stack([proc(torch.tensor([[1, 4, 4, 9]]), logits[:1].clone())[0],
                            proc(torch.tensor([[2, 3]]), logits[1:].clone())[0]])
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("penalty", [1e-38, 1e38])
def test_extreme_repetition_penalties_keep_probabilities_finite(penalty):
    """A penalty of 1e-38 (a valid float32) made the seen positive logits +inf and the softmax NaN; sampled, the
    tokens must still be real tokens: the seen positive logit takes all the probability (1e-38), or the seen negative
    one none (1e38; the seen positive one drops to logit 0)."""
    logits = torch.tensor([[20.0, 15.0, -1.0, 0.5]]).repeat(64, 1)  # 20 / 1e-38 is beyond float32
    history = torch.tensor([[0, 2]]).repeat(64, 1)           # tokens 0 (positive logit) and 2 (negative) were seen
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    batch = batch_of(64, temperature=torch.full((64,), 0.8), repetition_penalty=torch.full((64,), penalty),
                     history=history, generators=gens, use_repetition_penalty=True, all_greedy=False,
                     want_logprobs=True)
    out = sample(logits, batch)
    assert torch.isfinite(apply_penalties(logits, batch)).all()
    ids = out.token_ids
    assert ((ids >= 0) & (ids < 4)).all()
    if penalty < 1:
        assert (ids == 0).all()                               # the boosted seen token takes all the probability
    else:
        assert not (ids == 2).any()


def test_presence_and_frequency_penalties():
    logits = torch.zeros(1, 6)
    out_ids = torch.tensor([[2, 2, 2, 5, -1]])
    ours = apply_penalties(logits, batch_of(1, presence_penalty=torch.tensor([0.5]),
                                            frequency_penalty=torch.tensor([0.25]), output_ids=out_ids))
    expected = torch.tensor([[0, 0, -(0.5 + 3 * 0.25), 0, 0, -(0.5 + 0.25)]])
    torch.testing.assert_close(ours, expected)


def test_logprobs_are_those_of_the_model():
    logits = torch.randn(2, 10)
    b = batch_of(2, temperature=torch.zeros(2), all_greedy=True, want_logprobs=True, num_logprobs=3)
    out = sample(logits, b)
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, logp.max(-1).values)
    torch.testing.assert_close(out.top_logprobs, logp.topk(3, -1).values)


def test_plain_argmax_only_for_greedy_rows_without_penalties_or_logprobs():
    """The decode graphs' own argmax stands in for `sample` exactly when this holds (engine/cuda_graph.py)."""
    assert SamplingBatch.greedy_only().plain_argmax
    logits = torch.randn(2, 50)
    assert torch.equal(sample(logits, SamplingBatch.greedy_only()).token_ids, logits.argmax(dim=-1))
    greedy = batch_of(2, temperature=torch.zeros(2), all_greedy=True, use_repetition_penalty=False,
                      use_presence_frequency=False)
    assert greedy.plain_argmax
    for change in ({"want_logprobs": True}, {"use_repetition_penalty": True}, {"use_presence_frequency": True},
                   {"all_greedy": False}):
        assert not dataclasses.replace(greedy, **change).plain_argmax, change
