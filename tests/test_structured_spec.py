"""Structured outputs under speculative decoding (the trained tiny model, CPU, torch backend): constrained rows
speculate with drafts cut where the grammar refuses them and each verify row masked by the grammar after the drafts
before it. Prompt lookup drafts from prompts that show the schema's keys, which the grammar forces, so constrained
rows verify and accept drafts. Greedy output is token for token the plain engine's, next to unconstrained rows;
with every draft accepted (forced) the output still obeys its grammar; rows still in or before their reasoning
draft nothing."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from orinfer import LLM, SamplingParams
from test_structured_engine import SCHEMA

REGEX = r"[a-z]{1,6}-[0-9]{2,3}"
EXAMPLE = '{"name": "Bob", "age": 30, "mood": "sad", "tags": ["x"], "ok": true}'
PROMPTS = [f"Alice wrote {EXAMPLE} and {EXAMPLE}", "Codes: ab-12, cd-345, ab-12.", "Down, down, down.",
           f"The rabbit said {EXAMPLE}"]


def engine(tiny_dir, spec: dict | None = None) -> LLM:
    config = None if spec is None else {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                        **spec}
    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False, speculative_config=config)


def requests(temperature: float = 0.0, max_tokens: int = 60) -> list[SamplingParams]:
    kinds = [{"json": SCHEMA}, {"regex": REGEX}, None, {"json": SCHEMA}]
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, structured_outputs=kind)
            for i, kind in enumerate(kinds)]


def test_greedy_constrained_rows_speculate_and_keep_the_plain_tokens(tiny_dir):
    want = engine(tiny_dir).generate(PROMPTS, requests())
    got = engine(tiny_dir, {}).generate(PROMPTS, requests())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for out in (got[0], got[3]):  # the keys the grammar forces came from the prompt's example
        assert out.metrics.num_accepted_tokens > 0, out.metrics


def test_every_accepted_draft_obeys_the_grammar(tiny_dir):
    """Forced acceptance 1.0 accepts every draft it is given: only drafts the grammar took get that far, and the token
    after them is sampled under the mask of where they left the grammar."""
    llm = engine(tiny_dir, {"forced_acceptance": 1.0})
    outs = llm.generate(PROMPTS, requests(temperature=1.0, max_tokens=200))  # (the schema bounds every value)
    validator = jsonschema_rs.validator_for(SCHEMA)
    for out in (outs[0], outs[3]):
        assert out.finish_reason == "stop" and validator.is_valid(json.loads(out.text)), out.text
        assert out.metrics.num_accepted_tokens > 0
    assert outs[1].finish_reason == "stop" and re.fullmatch(REGEX, outs[1].text), outs[1].text
    engine_ = llm.engine
    assert engine_.block_manager.num_free_blocks == engine_.block_manager.num_blocks


@pytest.mark.parametrize("state", ["start", "thinking"])
def test_rows_in_or_before_their_reasoning_keep_the_plain_tokens(tiny_dir, state):
    """A constraint whose output may still open <think> (or is inside it) drafts nothing until the answer starts;
    greedy tokens stay the plain engine's."""
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs={"json": SCHEMA}, think_state=state)
    want = engine(tiny_dir).generate(PROMPTS[:1], [params])[0]
    got = engine(tiny_dir, {}).generate(PROMPTS[:1], [params])[0]
    assert got.token_ids == want.token_ids
