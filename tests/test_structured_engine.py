"""Structured outputs through the engine on the trained tiny model (CPU, torch backend, lookahead on by default):
every output obeys its constraint while sampling at temperature 1, unconstrained neighbours are unaffected, and
seeds, preemption, chunked prefill, thinking and abort behave."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from orinfer import LLM, SamplingParams
from orinfer.engine import llm_engine
from orinfer.errors import RequestError
from orinfer.structured.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "curious"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Alice was beginning", "Down, down, down.", "The rabbit-hole went", "She took down a jar"]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False)


def _clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished() and engine.in_flight is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if engine._grammars is not None:  # every finished or aborted sequence gave its matcher's template back
        assert all(n == 0 for pool in engine._grammars._cache.values() for n in pool.live)


def test_json_schema_outputs_always_parse_and_validate(llm):
    validator = jsonschema_rs.validator_for(SCHEMA)
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured_outputs={"json": SCHEMA})
              for seed in range(8)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(8)], params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert validator.is_valid(value), out.text
    assert len({o.text for o in outs}) > 1  # really sampled
    # The 8 rows ran together, each on a copy of its own template (no two waiting on one lexer lock).
    assert len(llm.engine.grammars._cache[StructuredOutputsParams(json=SCHEMA).cache_key()].matchers) == 8
    _clean(llm)


def test_json_object_regex_and_choice_hold(llm):
    n = 4
    obj = llm.generate(PROMPTS[:2] * (n // 2), [SamplingParams(max_tokens=60, temperature=1.0, seed=s,
                                                               structured_outputs={"json_object": True})
                                                for s in range(n)])
    for out in obj:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # an object still open at max_tokens: a prefix of one
            assert out.text.startswith("{")
    regex = llm.generate(PROMPTS, [SamplingParams(max_tokens=30, temperature=1.0, seed=s,
                                                      structured_outputs={"regex": r"[a-z]{1,6}-[0-9]{2,3}"})
                                       for s in range(n)])
    import re
    for out in regex:
        assert re.fullmatch(r"[a-z]{1,6}-[0-9]{2,3}", out.text), out.text
        assert out.finish_reason == "stop"
    choices = ["the Rabbit", "Alice", "a golden key"]
    picked = llm.generate(PROMPTS, [SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                                       structured_outputs={"choice": choices}) for s in range(n)])
    assert all(o.text in choices and o.finish_reason == "stop" for o in picked)
    grammar = 'start: "yes" | "no" | num\nnum: /[0-9]{2}/\n'
    lark = llm.generate(PROMPTS, [SamplingParams(max_tokens=10, temperature=1.0, seed=s,
                                                 structured_outputs={"grammar": grammar}) for s in range(4)])
    assert all(o.text in ("yes", "no") or re.fullmatch("[0-9]{2}", o.text) for o in lark)
    _clean(llm)


@pytest.mark.parametrize("sampled", [False, True])
def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm, sampled):
    plain = SamplingParams(max_tokens=24, temperature=1.0 if sampled else 0.0, seed=7 if sampled else None)
    alone = llm.generate(PROMPTS[:2], plain)
    before = llm.engine.num_lookahead_steps
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[2:], [plain, plain] + [
        SamplingParams(max_tokens=10, temperature=1.0, seed=s, structured_outputs={"regex": "[a-z]{3}[0-9]"})
        for s in (1, 2)])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert all(len(o.text) == 4 and o.text[3].isdigit() for o in mixed[2:])
    assert llm.engine.num_lookahead_steps - before >= 20  # the constrained rows did not stop lookahead
    _clean(llm)


def test_constrained_decoding_keeps_lookahead(tiny_dir, llm):
    """Lookahead steps still run (their sampler waits for the masks) and give the tokens of an engine without it."""
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs={"json": SCHEMA})
              for s in range(3)] + [SamplingParams(max_tokens=30, temperature=0.0)]
    before = llm.engine.num_lookahead_steps
    got = llm.generate(PROMPTS, params)
    assert llm.engine.num_lookahead_steps - before >= 25
    plain = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, async_scheduling=False)
    want = plain.generate(PROMPTS, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(o.token_ids, o.text, o.finish_reason)
                                                                       for o in want]
    _clean(llm)


def test_seeded_constrained_output_is_reproducible(llm):
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, structured_outputs={"json": SCHEMA})
    first = llm.generate(PROMPTS[1], params)[0]
    again = llm.generate([PROMPTS[1], PROMPTS[0]], [params, SamplingParams(max_tokens=30, temperature=1.0)])[0]
    assert first.token_ids == again.token_ids


def test_preemption_and_chunked_prefill_keep_constrained_tokens(tiny_dir, llm):
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs={"json": SCHEMA})
              for s in range(4)]
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    tight = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, block_size=4, num_kv_blocks=24)
    outs = tight.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    _clean(tight)
    chunked = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_num_batched_tokens=3)
    assert [o.token_ids for o in chunked.generate(PROMPTS, params)] == expected


def test_stop_strings_and_abort_free_the_matcher(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, stop=["-"],
                                                  structured_outputs={"regex": "[a-z]{3}-[0-9]{3}"}))[0]
    assert out.text.isalpha() and len(out.text) == 3 and out.finish_reason == "stop"
    engine = llm.engine
    seq = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=30, structured_outputs={"json": SCHEMA}))
    engine.step()
    assert seq.constraint is not None
    engine.abort(seq.request_id)
    assert seq.constraint is None
    while engine.has_unfinished():
        engine.step()
    engine.release(seq.request_id)
    _clean(llm)


def test_invalid_constraint_is_a_request_error(llm):
    with pytest.raises(RequestError, match="structured_outputs.json is not supported: .*nonsense"):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs={"json": {"type": "nonsense"}}))
    _clean(llm)


def test_constraint_applies_after_think_end(llm, monkeypatch):
    """The tiny model never writes </think>; so a token it does write greedily plays </think> here: the tokens up to
    and including it are the unconstrained ones, the rest obeys the constraint."""
    free = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))[0].token_ids
    end_token = llm.tokenizer.id_to_token(free[3])
    assert free.index(free[3]) == 3
    monkeypatch.setattr(llm_engine, "THINK_END", end_token)
    spec = {"regex": "[0-9]{4}"}
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, think_state="thinking",
                                                  structured_outputs=spec))[0]
    assert out.token_ids[:4] == free[:4]
    answer = llm.tokenizer.decode(out.token_ids[4:])
    assert len(answer) == 4 and answer.isdigit() and out.finish_reason == "stop"
    # Without thinking the constraint holds from the first token.
    direct = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=spec))[0]
    assert len(direct.text) == 4 and direct.text.isdigit()


def test_chat_sets_the_think_state_from_the_prompt(llm):
    messages = [{"role": "user", "content": "Who is Alice?"}]
    spec = {"choice": ["yes", "no"]}
    off = llm.chat(messages, SamplingParams(max_tokens=8, structured_outputs=spec), enable_thinking=False)[0]
    assert off.text in ("yes", "no")


def test_tool_call_grammar_drives_generation(llm):
    from orinfer.structured.tool_calls import tool_call_constraint

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}}]
    spec = tool_call_constraint("qwen-json", tools, parallel=False)
    outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs=spec,
                                                 skip_special_tokens=False) for s in range(2)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert out.text.startswith("<tool_call>\n") and out.text.endswith("\n</tool_call>")
        call = json.loads(out.text[len("<tool_call>\n"):-len("\n</tool_call>")])
        assert call["name"] == "get_weather" and set(call["arguments"]) == {"city", "days"}
