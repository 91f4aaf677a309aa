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


# --- structured-output masks --------------------------------------------------------------------------------------

def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """Reference packing, one token at a time: bit i%32 of int32 word i//32 is token i."""
    rows, vocab = allowed.shape
    words = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int64)
    for r in range(rows):
        for t in range(vocab):
            if allowed[r, t]:
                words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


@pytest.mark.parametrize("vocab", [5, 32, 70, 96])
def test_token_bitmask_matches_reference(vocab):
    from orinfer.layers.sampler import apply_token_bitmask, unpack_bitmask

    gen = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(3, vocab, generator=gen) < 0.3
    allowed[:, 0] = True
    allowed[1, vocab - 1] = True  # the last id, bit 31 of a full word when vocab is a multiple of 32
    packed = _pack(allowed)
    assert torch.equal(unpack_bitmask(packed, vocab), allowed)
    # A logits row wider than the mask (the model's vocabulary beyond the tokenizer's): the extra ids are refused.
    assert not unpack_bitmask(packed, vocab + 40)[:, vocab:].any()
    logits = torch.randn(5, vocab, generator=gen)
    rows = torch.tensor([3, 0, 4])
    out = apply_token_bitmask(logits, rows, packed)
    expected = logits.clone()
    for i, r in enumerate(rows.tolist()):
        for t in range(vocab):
            if not allowed[i, t]:
                expected[r, t] = float("-inf")
    assert torch.equal(out, expected)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[2], logits[2])  # unconstrained rows untouched


def test_masked_tokens_are_never_sampled_even_with_penalties_and_greedy():
    vocab = 40
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen) * 3
    allowed = torch.zeros(4, vocab, dtype=torch.bool)
    allowed[:, [3, 17, 33]] = True
    temps = torch.tensor([0.0, 1.0, 1.0, 0.7])
    history = torch.arange(vocab).repeat(4, 1)  # every token seen: the repetition penalty touches all of them
    n = 500
    seen = set()
    for trial in range(n // 4):
        batch = batch_of(4, temperature=temps, repetition_penalty=torch.full((4,), 1e-30), history=history,
                         output_ids=history, frequency_penalty=torch.full((4,), -2.0), top_k=torch.full((4,), 30),
                         generators=[torch.Generator().manual_seed(trial * 4 + i) for i in range(4)],
                         constrained_rows=torch.arange(4), token_bitmask=_pack(allowed))
        ids = sample(logits, batch).token_ids.tolist()
        seen.update(ids)
    assert seen <= {3, 17, 33}
    # Greedy under the mask is the argmax over the allowed tokens.
    greedy = sample(logits, batch_of(4, temperature=torch.zeros(4), constrained_rows=torch.arange(4),
                                     token_bitmask=_pack(allowed))).token_ids
    assert greedy.tolist() == logits[:, [3, 17, 33]].argmax(dim=1).apply_(lambda i: [3, 17, 33][i]).tolist()


def test_mask_keeps_sampling_batch_off_plain_argmax():
    batch = SamplingBatch.greedy_only()
    assert batch.plain_argmax
    batch.token_bitmask = torch.zeros(1, 1, dtype=torch.int32)
    batch.constrained_rows = torch.zeros(1, dtype=torch.int64)
    assert not batch.plain_argmax
