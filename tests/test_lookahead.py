"""One-step lookahead (EngineArgs.async_scheduling): the same tokens as waiting for every step, on the CPU.

Each test runs the same requests through an engine with lookahead and one without and compares everything a caller
sees; `num_lookahead_steps` proves the lookahead path actually ran where it should (and not where it must drain).
"""

from __future__ import annotations

import pytest
import torch

from lookahead_helpers import PROMPTS
from lookahead_helpers import lookahead_llm as _llm
from lookahead_helpers import seen as _seen
from orinfer import LLM, SamplingParams

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def on(tiny_dir):
    return _llm(tiny_dir, True)


@pytest.fixture(scope="module")
def off(tiny_dir):
    return _llm(tiny_dir, False)


def _generate(llm: LLM, prompts, params) -> tuple[list, int]:
    """Outputs, and the lookahead launches they took; the engine must end clean (no step in flight, no block held)."""
    before = llm.engine.num_lookahead_steps
    outs = llm.generate(prompts, params)
    engine = llm.engine
    assert not engine.has_unfinished() and engine.in_flight is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outs, engine.num_lookahead_steps - before


def test_default_is_on_and_off_switch_works(on, off):
    assert on.engine.lookahead and not off.engine.lookahead
    _, launches = _generate(off, "Alice", SamplingParams(max_tokens=8, **GREEDY))
    assert launches == 0


def test_batch_one_same_tokens_and_lookahead_happened(on, off):
    params = SamplingParams(max_tokens=30, **GREEDY)
    want, _ = _generate(off, "Alice was beginning to get very", params)
    got, launches = _generate(on, "Alice was beginning to get very", params)
    assert _seen(got) == _seen(want)
    # Prefill, then 29 decode steps: every decode step was launched behind the step before it, the first behind the
    # prefill (the last token is certainly the last one, by length, so no step is launched behind it).
    assert launches == 29
    m = got[0].metrics
    assert m.num_generated_tokens == 30 and m.decode_tok_s > 0 and m.ttft_s > 0 and m.prefill_tok_s > 0


def test_sequences_finishing_at_different_steps(on, off):
    """max_tokens, a stop token and a stop string end the sequences at different steps; a sequence that stops on a
    token is already in the next launched step, whose row for it must be dropped."""
    full, _ = _generate(off, PROMPTS, SamplingParams(max_tokens=24, **GREEDY))
    stop_str = full[3].text[10:14]
    params = [SamplingParams(max_tokens=5, **GREEDY), SamplingParams(max_tokens=24, **GREEDY),
              SamplingParams(max_tokens=24, stop_token_ids=[full[2].token_ids[8]], **GREEDY),
              SamplingParams(max_tokens=24, stop=[stop_str], **GREEDY)]
    want, _ = _generate(off, PROMPTS, params)
    got, launches = _generate(on, PROMPTS, params)
    assert _seen(got) == _seen(want)
    assert [o.finish_reason for o in got] == ["length", "length", "stop", "stop"]
    assert len({len(o.token_ids) for o in got}) >= 3
    assert launches > 0


def test_requests_added_mid_run(on, off):
    """New requests between decode steps: the in-flight step drains, the prefill runs, lookahead resumes."""
    params = SamplingParams(max_tokens=16, **GREEDY)

    def drive(llm: LLM) -> list:
        engine = llm.engine
        seqs = [engine.add_request(on.tokenizer.encode(PROMPTS[0]), params)]
        for step in range(40):
            if step in (3, 7):
                seqs.append(engine.add_request(on.tokenizer.encode(PROMPTS[len(seqs)]), params))
            engine.step()
        while engine.has_unfinished():
            engine.step()
        for seq in seqs:
            engine.release(seq.request_id)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return [(s.completion_token_ids, s.output_text, s.finish_reason) for s in seqs]

    before = on.engine.num_lookahead_steps
    assert drive(on) == drive(off)
    assert on.engine.num_lookahead_steps - before > 16  # lookahead resumed after each prefill


def test_preemption_same_tokens(tiny_dir):
    params = SamplingParams(max_tokens=40, **GREEDY)
    runs = []
    for lookahead in (False, True):
        tight = _llm(tiny_dir, lookahead, block_size=4, num_kv_blocks=16)
        outs, launches = _generate(tight, PROMPTS, params)
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        runs.append((_seen(outs), launches))
    assert runs[0][0] == runs[1][0]
    assert runs[1][1] > 0


def test_full_batch_with_a_queue_keeps_looking_ahead(tiny_dir):
    """Requests queued behind max_num_seqs do not stop the lookahead (only one that can be admitted now does)."""
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (6, 20, 9, 14)]
    runs = []
    for lookahead in (False, True):
        outs, launches = _generate(_llm(tiny_dir, lookahead, max_num_seqs=2), PROMPTS, params)
        runs.append((_seen(outs), launches))
    assert runs[0][0] == runs[1][0]
    assert runs[1][1] > 20


def test_abort_mid_decode_frees_blocks(on, off):
    params = SamplingParams(max_tokens=20, **GREEDY)
    want, _ = _generate(off, PROMPTS[:2], params)
    engine = on.engine
    free = engine.block_manager.num_free_blocks
    a, b = (engine.add_request(on.tokenizer.encode(p), params) for p in PROMPTS[:2])
    while a.num_completion_tokens < 6:
        engine.step()
    assert engine.in_flight is not None and a in engine.in_flight.seqs  # a's next token is on its way
    engine.abort(a.request_id)
    assert a.finish_reason == "abort" and a.num_pending == 0
    kept = a.completion_token_ids
    advanced = []
    while engine.has_unfinished():
        advanced += engine.step()
    assert a not in advanced and a.completion_token_ids == kept  # its in-flight token was dropped
    assert kept == want[0].token_ids[:len(kept)]
    assert b.completion_token_ids == want[1].token_ids and b.finish_reason == "length"
    engine.release(b.request_id)
    assert engine.block_manager.num_free_blocks == free


def test_abort_of_everything_in_flight(on):
    """An in-flight step whose sequences were all aborted keeps has_unfinished() true until a step collects it."""
    engine = on.engine
    seq = engine.add_request(on.tokenizer.encode(PROMPTS[1]), SamplingParams(max_tokens=20, **GREEDY))
    while seq.num_completion_tokens < 3:
        engine.step()
    engine.abort(seq.request_id)
    assert engine.has_unfinished() and engine.in_flight is not None
    assert engine.step() == []
    assert not engine.has_unfinished()


def test_seeded_sampling_and_logprobs(on, off):
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_k=0, top_p=1.0, seed=1234, logprobs=2),
              SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=7),
              SamplingParams(max_tokens=18, logprobs=3, **GREEDY)]
    want, _ = _generate(off, PROMPTS[:3], params)
    got, launches = _generate(on, PROMPTS[:3], params)
    assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in want]
    for g, w in zip(got, want):
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-5)
        assert [[t for t, _ in lp.top] for lp in g.logprobs] == [[t for t, _ in lp.top] for lp in w.logprobs]
    assert launches > 0


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.5),
                                       dict(repetition_penalty=1.05, presence_penalty=0.3)])
def test_penalties_keep_lookahead_and_match(on, off, penalties):
    """Penalties count the token still on the device too (appended on the device): same tokens, lookahead kept (as
    Qwen2.5's generation_config, repetition_penalty 1.05, makes every default request use one)."""
    params = [SamplingParams(max_tokens=16, **penalties, **GREEDY), SamplingParams(max_tokens=16, **GREEDY),
              SamplingParams(max_tokens=16, seed=3, temperature=0.8, **penalties)]
    want, _ = _generate(off, PROMPTS[:3], params)
    got, launches = _generate(on, PROMPTS[:3], params)
    assert _seen(got) == _seen(want)
    assert launches > 0


def test_penalty_history_holds_the_pending_token(on, monkeypatch):
    """In a lookahead step the history the penalties read is every known token plus the one still on the device,
    and it is a prefix of what the sequence finally holds."""
    runner = on.engine.runner
    calls = []
    real = runner.sampling_batch

    def spy(seqs, pending=None, **kwargs):
        batch = real(seqs, pending, **kwargs)
        calls.append(([list(s.token_ids) for s in seqs], pending is not None, batch.history.clone()))
        return batch

    monkeypatch.setattr(runner, "sampling_batch", spy)
    outs, launches = _generate(on, PROMPTS[:2], SamplingParams(max_tokens=12, repetition_penalty=1.2, **GREEDY))
    assert launches > 0
    finals = [o.prompt_token_ids + o.token_ids for o in outs]
    lookahead_rows = 0
    for known, pending, history in calls:
        for row, ids in zip(history.tolist(), known):
            seen = [t for t in row if t >= 0]
            full = next(f for f in finals if f[:len(ids)] == ids)
            assert len(seen) == len(ids) + (1 if pending else 0)
            assert sorted(seen) == sorted(full[:len(seen)])
            lookahead_rows += pending
    assert lookahead_rows > 0


def test_stream_and_step_contract(on, off):
    """stream() equals generate(); step() only returns sequences with a new token, and no count includes a token
    still on the device."""
    params = SamplingParams(max_tokens=12, **GREEDY)
    assert "".join(on.stream(PROMPTS[2], params)) == _generate(off, PROMPTS[2], params)[0][0].text
    engine = on.engine
    seq = engine.add_request(on.tokenizer.encode(PROMPTS[0]), params)
    counts = []
    while engine.has_unfinished():
        advanced = engine.step()
        assert advanced == [seq]
        counts.append(seq.num_completion_tokens)
        assert len(seq.completion_token_ids) == seq.num_completion_tokens
    assert counts == list(range(1, 13))
    engine.release(seq.request_id)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_same_tokens_with_and_without_lookahead(tiny_dir, graphs):
    """The device path: ids gathered into the CUDA graph's input buffer (or the eager batch), copies to the host
    behind each step, staging buffers used in turn. Greedy, seeded and logprob requests, finishing at different
    steps."""
    params = [SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY),
              SamplingParams(max_tokens=25, temperature=1.0, top_k=0, top_p=1.0, seed=3, logprobs=2),
              SamplingParams(max_tokens=33, **GREEDY), SamplingParams(max_tokens=9, logprobs=1, **GREEDY)]
    runs = []
    for lookahead in (False, True):
        llm = LLM(tiny_dir, dtype="float32", device="cuda", backend="triton", progress=False, cuda_graph=graphs,
                  kv_cache_bytes=64 << 20, max_num_seqs=8, async_scheduling=lookahead)
        assert (llm.engine.runner.graphs is not None) == graphs
        outs, launches = _generate(llm, PROMPTS, params)
        runs.append(([(o.token_ids, o.text, o.finish_reason) for o in outs], launches))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == 0 and runs[1][1] > 0


def test_a_chunked_prompt_counts_its_prefill_time_once(tiny_dir):
    """A prompt in several chunks under lookahead: each chunk's step is launched before the one before it resolves, so
    their spans overlap; the prefill time counts their union (never more than the time to the first token), not
    their sum."""
    llm = _llm(tiny_dir, True, max_num_batched_tokens=16)
    prompt = " ".join(PROMPTS * 4)
    out = llm.generate(prompt, SamplingParams(max_tokens=2, **GREEDY))[0]
    m = out.metrics
    assert m.num_prompt_tokens > 3 * 16 and llm.engine.num_lookahead_steps >= 3
    assert m.num_prompt_tokens / m.prefill_tok_s <= m.ttft_s
