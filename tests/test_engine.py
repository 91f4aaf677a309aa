"""Engine behaviour on a trained tiny model: stops, streaming, seeds, preemption, chat, defaults."""

from __future__ import annotations

import pytest

from orinfer import LLM, SamplingParams
from orinfer.tokenizer_train import bundled_corpus

GREEDY = dict(temperature=0.0)


@pytest.mark.parametrize("prompt", ["Alice was beginning to get very", "The rabbit-hole went"])
def test_greedy_continues_the_training_text(tiny_llm, prompt):
    """make-tiny trains on the bundled text: greedy decoding of a (unique, word-aligned) prefix continues it."""
    text = bundled_corpus()
    truth = text[text.index(prompt) + len(prompt):]
    out = tiny_llm.generate(prompt, SamplingParams(max_tokens=30, **GREEDY))[0]
    assert len(out.text) > 60
    assert truth.startswith(out.text[:60]), (out.text, truth[:100])


def test_stop_string_truncates_and_stream_never_shows_it(tiny_llm):
    prompt = "Alice was beginning to get very"
    full = tiny_llm.generate(prompt, SamplingParams(max_tokens=40, **GREEDY))[0].text
    stop = "sister"
    assert stop in full
    out = tiny_llm.generate(prompt, SamplingParams(max_tokens=40, stop=stop, **GREEDY))[0]
    assert out.text == full[:full.index(stop)]
    assert out.finish_reason == "stop"
    deltas = list(tiny_llm.stream(prompt, SamplingParams(max_tokens=40, stop=[stop], **GREEDY)))
    assert "".join(deltas) == out.text
    assert all(stop not in d for d in deltas)
    kept = tiny_llm.generate(prompt, SamplingParams(max_tokens=40, stop=stop, include_stop_str_in_output=True,
                                                    **GREEDY))[0]
    assert kept.text == full[:full.index(stop) + len(stop)]


def test_stream_equals_generate(tiny_llm):
    params = SamplingParams(max_tokens=30, **GREEDY)
    prompt = "Down, down, down."
    assert "".join(tiny_llm.stream(prompt, params)) == tiny_llm.generate(prompt, params)[0].text


def test_max_tokens_and_stop_token_ids(tiny_llm):
    out = tiny_llm.generate("Alice", SamplingParams(max_tokens=5, **GREEDY))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    first = out.token_ids[2]
    stopped = tiny_llm.generate("Alice", SamplingParams(max_tokens=5, stop_token_ids=[first], **GREEDY))[0]
    assert stopped.token_ids == out.token_ids[:3] and stopped.finish_reason == "stop"


def test_eos_stops_generation(tiny_llm):
    eos = tiny_llm.tokenizer.token_to_id("<|im_end|>")
    # The tiny model rarely emits EOS on its own, so the rule is checked directly on a queued sequence.
    engine = tiny_llm.engine
    assert eos in engine.eos_token_ids
    seq = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    try:
        seq.append_token(eos)
        assert engine._stop_reason(seq, eos) == "stop"
        seq.params.min_tokens = 2
        assert engine._stop_reason(seq, eos) is None  # too early: min_tokens not reached
        seq.params.ignore_eos, seq.params.min_tokens = True, 0
        assert engine._stop_reason(seq, eos) is None
    finally:
        engine.abort(seq.request_id)


def test_same_seed_same_tokens_whatever_the_batch(tiny_llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=1.0, top_k=0, seed=1234)
    alone = tiny_llm.generate("The rabbit", params)[0].token_ids
    again = tiny_llm.generate("The rabbit", params)[0].token_ids
    batched = tiny_llm.generate(["Alice", "The rabbit", "Down"], [
        SamplingParams(max_tokens=10, temperature=1.0, seed=7), params, SamplingParams(max_tokens=30, temperature=0.9)])
    assert alone == again == batched[1].token_ids
    other = tiny_llm.generate("The rabbit", SamplingParams(max_tokens=24, temperature=1.0, top_k=0, top_p=1.0,
                                                            seed=99))[0].token_ids
    assert other != alone


def test_generation_config_defaults_apply(tiny_llm):
    params = SamplingParams().with_defaults(tiny_llm.engine.generation_config)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    explicit = SamplingParams(temperature=0.0, top_k=-1).with_defaults(tiny_llm.engine.generation_config)
    assert explicit.greedy and explicit.top_k == 0


def test_preemption_keeps_tokens_identical(tiny_dir):
    """A cache too small for all sequences at once forces preemption; recompute must not change any token."""
    prompts = ["Alice was beginning", "Down, down, down.", "The rabbit-hole went", "She took down a jar"]
    params = SamplingParams(max_tokens=40, **GREEDY)
    roomy = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, block_size=4)
    tight = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, block_size=4, num_kv_blocks=16)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert tight.engine.block_manager.num_free_blocks == 16  # everything freed at the end


def test_chat_uses_template_and_thinking_switch(tiny_llm):
    messages = [{"role": "user", "content": "Who is Alice?"}]
    prompt = tiny_llm.render_chat(messages, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out = tiny_llm.chat(messages, SamplingParams(max_tokens=8, **GREEDY), enable_thinking=False)[0]
    assert out.prompt == prompt and len(out.token_ids) >= 1


def test_metrics_are_filled(tiny_llm):
    m = tiny_llm.generate("Alice", SamplingParams(max_tokens=8, **GREEDY))[0].metrics
    assert m.num_prompt_tokens >= 1 and m.num_generated_tokens == 8
    assert m.ttft_s > 0 and m.prefill_tok_s > 0 and m.decode_tok_s > 0


def test_logprobs_are_returned(tiny_llm):
    out = tiny_llm.generate("Alice", SamplingParams(max_tokens=4, logprobs=3, **GREEDY))[0]
    assert len(out.logprobs) == 4
    for lp, token in zip(out.logprobs, out.token_ids):
        assert lp.token_id == token and lp.logprob <= 0
        assert lp.top[0][0] == token  # greedy picks the most likely token
        assert len(lp.top) == 3


def test_token_id_prompts(tiny_llm):
    ids = tiny_llm.tokenizer.encode("Alice was beginning")
    by_ids = tiny_llm.generate([ids], SamplingParams(max_tokens=6, **GREEDY))[0]
    by_text = tiny_llm.generate("Alice was beginning", SamplingParams(max_tokens=6, **GREEDY))[0]
    assert by_ids.token_ids == by_text.token_ids and by_ids.prompt is None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3-moe"])
def test_make_tiny_loads_in_hf(arch, tmp_path):
    """make-tiny's output is a valid HF checkpoint: transformers loads it and agrees on greedy tokens."""
    transformers = pytest.importorskip("transformers")
    import torch

    from orinfer.tiny import make_tiny

    path = make_tiny(tmp_path / arch, arch=arch, train_steps=0, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", device="cpu", progress=False)
    ids = llm.tokenizer.encode("Alice was beginning")
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    got = llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY))[0].token_ids
    assert got[:len(expected)] == expected
