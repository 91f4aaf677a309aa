"""Constrained lookahead steps whose masks are built while the next forward is queued (llm_engine.py's `_sample_ahead`,
a second step in flight): the same tokens as an engine without lookahead, whatever finishes, stops, shares a prompt,
carries penalties, ends its prompt inside a lookahead step or is aborted; and the engine ends clean."""

from __future__ import annotations

import pytest

from lookahead_helpers import PROMPTS
from lookahead_helpers import lookahead_llm as _llm
from lookahead_helpers import seen as _seen
from orinfer import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def on(tiny_dir):
    return _llm(tiny_dir, True)


@pytest.fixture(scope="module")
def off(tiny_dir):
    return _llm(tiny_dir, False)


def _run(llm: LLM, prompts, params) -> tuple[list, int]:
    """Outputs and the steps queued ahead for them; the engine must end clean (nothing in flight, no block held)."""
    engine = llm.engine
    before = engine.num_queued_steps
    outs = llm.generate(prompts, params)
    assert not engine.has_unfinished() and engine.in_flight is None and engine.queued is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outs, engine.num_queued_steps - before


def _json(seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 40), temperature=1.0, seed=seed,
                          structured_outputs={"json": SCHEMA}, **kw)


def test_mixed_lengths_stops_and_neighbours_match_no_lookahead(on, off):
    """Rows that finish at different steps (grammar complete, a regex or choice ending early, max_tokens, a stop
    string), beside unconstrained sampled and greedy rows, with log-probabilities."""
    params = [_json(0), _json(1, logprobs=2),
              SamplingParams(max_tokens=12, temperature=1.0, seed=2, structured_outputs={"regex": "[a-z]{2,5}"}),
              SamplingParams(max_tokens=12, temperature=1.0, seed=3, structured_outputs={"choice": ["yes", "no"]}),
              _json(4, max_tokens=7),
              _json(5, stop=['"age"']),
              SamplingParams(max_tokens=30, temperature=1.0, seed=6),
              SamplingParams(max_tokens=25, temperature=0.0)]
    prompts = [PROMPTS[i % 4] for i in range(len(params))]
    got, queued = _run(on, prompts, params)
    want, _ = _run(off, prompts, params)
    assert _seen(got) == _seen(want)
    assert queued >= 15  # the masks were built while the next forward was queued
    assert got[5].finish_reason == "stop" and '"age"' not in got[5].text


def test_one_prompt_several_samples_match(on, off):
    """n > 1 as the server runs it: one prompt, several seeded requests sharing its cached blocks."""
    params = [_json(seed) for seed in (11, 12, 13)]
    got, queued = _run(on, [PROMPTS[1]] * 3, params)
    want, _ = _run(off, [PROMPTS[1]] * 3, params)
    assert _seen(got) == _seen(want) and queued > 0
    assert len({tuple(o.token_ids) for o in got}) > 1


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.3), dict(presence_penalty=0.8,
                                                                          frequency_penalty=0.5)])
def test_penalties_count_both_pending_tokens(on, off, penalties):
    """A step queued ahead has two tokens of each row still unprocessed; the penalties must see both."""
    params = [_json(seed, **penalties) for seed in range(3)] + [SamplingParams(max_tokens=20, temperature=0.0,
                                                                               **penalties)]
    got, queued = _run(on, PROMPTS, params)
    want, _ = _run(off, PROMPTS, params)
    assert _seen(got) == _seen(want) and queued > 0


def test_prompts_ending_inside_queued_steps(tiny_dir, off):
    """Chunked prefill with a small budget: prompts end (and sample their first constrained token) in steps launched
    ahead, beside rows that decode."""
    params = [_json(seed, repetition_penalty=1.2) for seed in range(4)]
    chunked = _llm(tiny_dir, True, max_num_batched_tokens=6)
    got, queued = _run(chunked, PROMPTS, params)
    want, _ = _run(off, PROMPTS, params)
    assert _seen(got) == _seen(want) and queued > 0


def test_preemption_with_queued_steps(tiny_dir, off):
    params = [_json(seed, max_tokens=60) for seed in range(4)]
    tight = _llm(tiny_dir, True, block_size=4, num_kv_blocks=24)
    got, queued = _run(tight, PROMPTS, params)
    want, _ = _run(off, PROMPTS, params)
    assert _seen(got) == _seen(want) and queued > 0
    assert sum(o.metrics.num_preemptions for o in got) > 0


def test_abort_while_a_step_is_queued(on):
    engine = on.engine
    seqs = [engine.add_request(p, _json(seed)) for seed, p in enumerate(PROMPTS)]
    while engine.queued is None:
        engine.step()
    engine.abort(seqs[0].request_id)  # in both steps in flight
    engine.step()
    for seq in seqs[1:]:
        engine.abort(seq.request_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.in_flight is None and engine.queued is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(seq.constraint is None and seq.finish_reason == "abort" for seq in seqs)


def test_penalty_history_of_a_queued_step_holds_both_pending_tokens(on, monkeypatch):
    """The history the penalties read in a step queued ahead is every known token plus the two still unprocessed:
    a prefix of what the sequence finally holds."""
    runner = on.engine.runner
    calls = []
    real = runner.sampling_batch

    def spy(seqs, pending=None, **kwargs):
        batch = real(seqs, pending, **kwargs)
        calls.append(([list(s.token_ids) for s in seqs], batch.history.clone()))
        return batch

    monkeypatch.setattr(runner, "sampling_batch", spy)
    outs, queued = _run(on, PROMPTS[:3], [_json(seed, repetition_penalty=1.2) for seed in range(3)])
    assert queued > 0
    finals = [o.prompt_token_ids + o.token_ids for o in outs]
    extra = []
    for known, history in calls:
        for row, ids in zip(history.tolist(), known):
            seen = [t for t in row if t >= 0]
            full = next(f for f in finals if f[:len(ids)] == ids)
            if len(seen) > len(full):
                continue  # a row of a sequence that ended before it (its sample is dropped)
            assert sorted(seen) == sorted(full[:len(seen)])
            extra.append(len(seen) - len(ids))
    assert max(extra) == 2 and min(extra) >= 0
