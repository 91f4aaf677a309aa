"""logit_bias (OpenAI's): added to the logits before everything else, on every path that picks a token - greedy rows
(which may otherwise take a plain argmax), sampled rows, batches that mix biased and unbiased rows."""

from __future__ import annotations

import pytest
import torch

from orinfer import LLM, RequestError, SamplingParams
from orinfer.layers.sampler import SamplingBatch, apply_logit_bias, sample


def _batch(rows: int, temperature: float, ids=None, values=None) -> SamplingBatch:
    ones, zeros = torch.ones(rows), torch.zeros(rows)
    return SamplingBatch(temperature=torch.full((rows,), temperature), top_k=torch.zeros(rows, dtype=torch.int64),
                         top_p=ones, min_p=zeros, repetition_penalty=ones, presence_penalty=zeros,
                         frequency_penalty=zeros, history=None, output_ids=None, generators=[None] * rows,
                         all_greedy=temperature == 0, use_top_k_top_p=False, use_min_p=False,
                         use_repetition_penalty=False, use_presence_frequency=False, bias_ids=ids, bias_values=values)


def test_apply_logit_bias_adds_to_the_named_tokens_only():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[4, 7], [9, 0], [0, 0]])
    values = torch.tensor([[1.5, -2.0], [3.0, 0.0], [0.0, 0.0]])
    want = logits.clone()
    want[0, 4] += 1.5
    want[0, 7] -= 2.0
    want[1, 9] += 3.0
    assert torch.equal(apply_logit_bias(logits, _batch(3, 0.0, ids, values)), want)
    assert apply_logit_bias(logits, _batch(3, 0.0)) is logits  # no bias: nothing computed


def test_biased_greedy_rows_never_take_the_plain_argmax():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    biased = _batch(2, 0.0, torch.tensor([[11], [0]]), torch.tensor([[100.0], [0.0]]))
    assert not biased.plain_argmax and _batch(2, 0.0).plain_argmax
    out = sample(logits, biased).token_ids.tolist()
    assert out == [11, logits[1].argmax().item()]
    banned = _batch(1, 0.0, torch.tensor([[logits[0].argmax().item()]]), torch.tensor([[-100.0]]))
    assert sample(logits[:1], banned).token_ids.item() == logits[0].topk(2).indices[1].item()
    # Sampled rows: +100 on one token leaves the others no probability worth drawing.
    hot = _batch(2, 1.0, torch.tensor([[23], [31]]), torch.tensor([[100.0], [100.0]]))
    assert sample(logits, hot).token_ids.tolist() == [23, 31]


def test_engine_applies_logit_bias_per_row(tiny_llm):
    prompt = "Alice was beginning to get very"
    plain = tiny_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    forced_token = tiny_llm.tokenizer.encode(" rabbit")[0]
    outs = tiny_llm.generate(
        [prompt] * 4,
        [SamplingParams(max_tokens=6, temperature=0, logit_bias={forced_token: 100.0}),
         SamplingParams(max_tokens=6, temperature=0),
         SamplingParams(max_tokens=6, temperature=0.8, seed=3, logit_bias={str(forced_token): 100}),
         SamplingParams(max_tokens=1, temperature=0, logit_bias={plain[0]: -100.0})])
    assert outs[0].token_ids == [forced_token] * 6
    assert outs[1].token_ids == plain  # an unbiased row beside biased ones is unchanged
    assert outs[2].token_ids == [forced_token] * 6
    assert outs[3].token_ids != plain[:1]


@pytest.mark.parametrize("bias", [{5: 101.0}, {5: float("nan")}, {-1: 1.0}, {"x": 1.0}, [1, 2]])
def test_logit_bias_is_validated(bias):
    with pytest.raises(RequestError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_engine_refuses_ids_outside_the_vocabulary(tiny_llm):
    vocab = tiny_llm.engine.parts.model_config.vocab_size
    with pytest.raises(RequestError, match="logit_bias"):
        tiny_llm.generate(["hi"], SamplingParams(logit_bias={vocab: 1.0}))
