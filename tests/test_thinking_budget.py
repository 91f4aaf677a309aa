"""The thinking token budget: after that many reasoning tokens the engine closes the reasoning itself (the Qwen3
template's `\\n</think>\\n\\n`, tokenized) and the answer follows. The reference for the answer is a plain greedy
generation from the prompt + the reasoning + the closing tokens: the same tokens must follow. Checked with lookahead
on and off, small step budgets (the closing tokens then run as chunks), batches mixing budgets, max_tokens cutting
the closing text, stop strings, and the start state read from the prompt."""

from __future__ import annotations

import pytest

from orinfer import LLM, EngineArgs, RequestError, SamplingParams
from orinfer.engine.thinking import CLOSING_TEXT, ThinkState, ThinkTokens, state_after_prompt
from orinfer.reasoning import initial_state

MAX = 24


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False)


def _thinking_prompt(llm) -> list[int]:
    """A chat prompt that opens the reasoning (as thinking-only templates render it): the tiny model never closes it
    on its own."""
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Who is Alice?"}]) + "<think>\n"
    return llm.tokenizer.encode(text)


def _closing(llm) -> list[int]:
    return llm.tokenizer.encode(CLOSING_TEXT)


@pytest.mark.parametrize("settings", [{}, dict(async_scheduling=False), dict(max_num_batched_tokens=2),
                                      dict(block_size=4, num_kv_blocks=30),
                                      dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})],
                         ids=["default", "no-lookahead", "budget-2", "small-pool", "ngram"])
def test_reasoning_is_cut_at_the_budget_and_the_answer_follows(tiny_dir, llm, settings):
    outs = _cut_at_budgets(LLM(tiny_dir, dtype="float32", device="cpu", progress=False, **settings), llm)
    if "speculative_config" in settings:  # drafts were verified inside the reasoning, up to each budget
        assert sum(o.metrics.num_draft_tokens for o in outs[1:-1]) > 0


def test_a_budget_reached_in_a_verify_step(tiny_dir, llm):
    """The model drafting for itself keeps every step a verify step, so each reasoning reaches its budget in one:
    the step computed its own tokens only, and the closing text the host appends after them runs in the next steps
    (counted as computed there, its positions' K/V would never be written)."""
    spec = {"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 3}
    outs = _cut_at_budgets(LLM(tiny_dir, dtype="float32", device="cpu", progress=False, speculative_config=spec), llm)
    assert all(o.metrics.num_verify_steps > 0 for o in outs)


def _cut_at_budgets(engine: LLM, llm: LLM) -> list:
    """Generates a thinking prompt under budgets 0, 1, 4, 9 and none, in one batch, and checks each output: the
    reasoning's first tokens as without a budget, the closing text, then what the model says after them."""
    prompt, closing = _thinking_prompt(llm), _closing(llm)
    free = engine.generate([prompt], SamplingParams(max_tokens=MAX, temperature=0))[0]
    assert llm.tokenizer.token_to_id("</think>") not in free.token_ids  # it would think on
    budgets = [0, 1, 4, 9]
    outs = engine.generate([prompt] * len(budgets) + [prompt],
                           [SamplingParams(max_tokens=MAX, temperature=0, thinking_token_budget=b) for b in budgets]
                           + [SamplingParams(max_tokens=MAX, temperature=0)])
    assert outs[-1].token_ids == free.token_ids  # no budget: untouched, beside the others
    for b, out in zip(budgets, outs):
        ids = out.token_ids
        assert ids[:b] == free.token_ids[:b]                   # the reasoning, exactly `b` tokens of it
        assert ids[b:b + len(closing)] == closing               # then the closing text
        assert len(ids) == MAX and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(ids)            # text and token count agree
        # The answer is what the model says after that exact context.
        head = prompt + ids[:b + len(closing)]
        ref = llm.generate([head], SamplingParams(max_tokens=MAX - b - len(closing), temperature=0))[0]
        assert ids[b + len(closing):] == ref.token_ids
        reasoning, _, answer = out.text.partition("</think>")
        assert answer.startswith("\n\n")
    return outs


def test_prompt_that_closed_its_reasoning_is_all_answer(llm):
    """enable_thinking=False renders an empty, closed reasoning: the output is the answer, no budget applies."""
    closed = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": "Who is Alice?"}],
                                                                     enable_thinking=False))
    free = llm.generate([closed], SamplingParams(max_tokens=12, temperature=0))[0]
    out = llm.generate([closed], SamplingParams(max_tokens=12, temperature=0, thinking_token_budget=0))[0]
    assert out.token_ids == free.token_ids


def test_generated_think_tag_starts_the_count(llm):
    """A prompt that leaves it to the output (START): the <think> the model writes opens the reasoning, and the budget
    counts the tokens after it. A +100 bias on <think> makes the model write it, and keep writing it inside the
    reasoning (those count: they are not </think>)."""
    think = llm.tokenizer.token_to_id("<think>")
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": "Who is Alice?"}]))
    closing = _closing(llm)
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX, temperature=0, thinking_token_budget=3,
                                                logit_bias={think: 100.0}))[0]
    assert out.token_ids[:4] == [think] * 4  # the opening tag, then 3 reasoning tokens
    assert out.token_ids[4:4 + len(closing)] == closing


def test_max_tokens_cuts_the_closing_text_and_stop_strings_apply(llm):
    prompt, closing = _thinking_prompt(llm), _closing(llm)
    cut = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, thinking_token_budget=2))[0]
    assert cut.token_ids[2:] == closing[:1] and cut.finish_reason == "length"
    stop = llm.generate([prompt], SamplingParams(max_tokens=MAX, temperature=0, thinking_token_budget=2,
                                                 stop=["</think>"]))[0]
    assert stop.finish_reason == "stop" and "</think>" not in stop.text
    assert stop.token_ids[2:] == closing[:2]  # it stopped inside the closing text, where the stop string ended
    # Budget 0 on a prompt that opened the reasoning: the closing text comes at admission; a stop string in it ends
    # the sequence at its first step (the token sampled there is not in the text).
    first = llm.generate([prompt], SamplingParams(max_tokens=MAX, temperature=0, thinking_token_budget=0,
                                                  stop=["</think>"]))[0]
    assert first.finish_reason == "stop" and first.text == "\n" and first.token_ids[:2] == closing[:2]
    tiny = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, thinking_token_budget=0))[0]
    assert tiny.token_ids[:1] == closing[:1] and tiny.finish_reason == "length"  # one token kept to sample


def test_engine_default_and_request_override(tiny_dir, llm):
    prompt, closing = _thinking_prompt(llm), _closing(llm)
    engine = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, thinking_token_budget=2)
    default, override = engine.generate([prompt] * 2, [SamplingParams(max_tokens=10, temperature=0),
                                                       SamplingParams(max_tokens=10, temperature=0,
                                                                      thinking_token_budget=5)])
    assert default.token_ids[2:2 + len(closing)] == closing
    assert override.token_ids[5:5 + len(closing)] == closing
    with pytest.raises(Exception, match="thinking_token_budget"):
        EngineArgs(thinking_token_budget=-1)
    with pytest.raises(RequestError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-2)


def test_start_state_rules_agree_on_text_and_ids(llm):
    tok = llm.tokenizer
    tokens = ThinkTokens.of(tok)
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\nyo"},
              {"role": "user", "content": "again"}]]
    seen = set()
    for messages in chats:
        for suffix in ("", "<think>\n", "<think>\n\n</think>\n\n"):
            text = tok.apply_chat_template(messages) + suffix
            by_ids = state_after_prompt(tok.encode(text), tokens.turn, tokens.start, tokens.end)
            assert by_ids is initial_state(text)
            seen.add(by_ids)
    assert seen == {ThinkState.START, ThinkState.THINKING, ThinkState.CONTENT}
