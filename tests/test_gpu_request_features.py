"""The request features that touch the sampler and the step loop, on the GPU's triton backend with CUDA graphs and
lookahead, against the same engine run eagerly (no graphs, no lookahead) on the same GPU, fp32, the trained tiny
Qwen3: logit_bias (a biased row must never take the decode graph's in-graph argmax), structured outputs (a constrained
lookahead step samples a graph's logits after the host built its mask), the thinking budget (closing tokens appended
between graph steps) and prompt log-probabilities (from mixed-step graphs' hidden states)."""

from __future__ import annotations

import json

import pytest
import torch

from orinfer import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ALICE = "Alice was beginning to get very tired of sitting by her sister on the bank"
GREEDY = dict(temperature=0.0, max_tokens=24)


def engine(tiny_dir, graphs: bool) -> LLM:
    return LLM(tiny_dir, dtype="float32", device="cuda", backend="triton", progress=False, kv_cache_bytes=64 << 20,
               max_num_seqs=8, max_num_batched_tokens=64, cuda_graph=graphs, async_scheduling=graphs)


@pytest.fixture(scope="module")
def pair(tiny_dir):
    fast, eager = engine(tiny_dir, True), engine(tiny_dir, False)
    assert fast.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    return fast, eager


def _both(pair, prompts, params):
    fast, eager = pair
    return fast.generate(prompts, params), eager.generate(prompts, params)


def test_logit_bias_beside_unbiased_rows(pair):
    fast, _ = pair
    forced = fast.tokenizer.encode(" rabbit")[0]
    params = [SamplingParams(logit_bias={forced: 100.0}, **GREEDY), SamplingParams(**GREEDY),
              SamplingParams(logit_bias={forced: -100.0}, **GREEDY)]
    got, want = _both(pair, [ALICE] * 3, params)
    assert got[0].token_ids == [forced] * GREEDY["max_tokens"]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_structured_outputs_with_graphs_and_lookahead(pair):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json": schema}),
              SamplingParams(**GREEDY), SamplingParams(temperature=0.0, max_tokens=8,
                                                       structured_outputs={"choice": ["yes", "no"]}),
              SamplingParams(temperature=0.0, max_tokens=64, repetition_penalty=1.2, logprobs=2,
                             structured_outputs={"json": schema})]
    queued = pair[0].engine.num_queued_steps
    got, want = _both(pair, [ALICE] * 4, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].finish_reason == "stop" and set(json.loads(got[0].text)) == {"name", "age"}
    assert got[2].text in ("yes", "no")
    assert pair[0].engine.num_lookahead_steps > 0
    # Steps queued before the previous tokens were processed: their sampler read a graph's logits after the masks
    # of the next step's forward had been built (kernels/token_bitmask.py applies them).
    assert pair[0].engine.num_queued_steps > queued


def test_thinking_budget_between_graph_steps(pair):
    fast, _ = pair
    prompt = fast.tokenizer.apply_chat_template([{"role": "user", "content": "Who is Alice?"}]) + "<think>\n"
    params = [SamplingParams(thinking_token_budget=b, temperature=0.0, max_tokens=32) for b in (0, 3, 9)]
    got, want = _both(pair, [prompt] * 3, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all("</think>" in o.text for o in got)


def test_prompt_logprobs_from_mixed_step_graphs(pair):
    params = [SamplingParams(prompt_logprobs=3, **GREEDY), SamplingParams(**GREEDY)]
    got, want = _both(pair, [ALICE, ALICE + " and of having"], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    a, b = got[0].prompt_logprobs, want[0].prompt_logprobs
    assert len(a) == len(b) == len(got[0].prompt_token_ids) and a[0] is None and b[0] is None
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a[1:], b[1:])) < 1e-4
