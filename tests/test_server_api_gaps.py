"""Server features beyond chat and completions proper (issue 33 items 3 and 4): /tokenize, /detokenize, /version,
/v1/models/{id}, stream_options (continuous_usage_stats; a 400 without stream), logit_bias, echo with prompt logprobs
(against HF transformers' forward of the tiny model), and the reasoning controls (thinking_token_budget,
reasoning_effort, chat_template_kwargs such as preserve_thinking, include_reasoning) with Qwen3.8's published chat
template, which opens the reasoning in the prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

from orinfer import LLM, __version__  # noqa: E402
from orinfer.engine.thinking import CLOSING_TEXT  # noqa: E402
from orinfer.server.app import ServerLimits, build_app  # noqa: E402
from orinfer.server.cli import BackgroundServer  # noqa: E402

ALICE = "Alice was beginning to get very tired of sitting by her sister on the bank"
QWEN38_TEMPLATE = Path(__file__).parent / "data" / "real-qwen" / "Qwen3.8-27B" / "chat_template.jinja"


@pytest.fixture(scope="module")
def server(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_num_batched_tokens=8)
    # Qwen3.8's template: `<think>\n` ends the generation prompt (the tiny model then thinks on and on), and it reads
    # reasoning_effort and preserve_thinking.
    llm.tokenizer.chat_template = QWEN38_TEMPLATE.read_text()
    with BackgroundServer(build_app(llm, "tiny", limits=ServerLimits(max_tokens=64))) as bg:
        yield bg


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def _sse(server, path, body):
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


CHAT = [{"role": "user", "content": "Who is Alice?"}]


# --- endpoints ---------------------------------------------------------------------------------------------------------

def test_tokenize_and_detokenize(server, tiny_dir):
    from orinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_dir)
    r = _post(server, "/tokenize", {"model": "tiny", "prompt": ALICE, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(ALICE) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0 and r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    assert _post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": ALICE}
    # Messages: the prompt /v1/chat/completions renders (its usage counts the same tokens).
    chat = _post(server, "/tokenize", {"messages": CHAT}).json()
    text = _post(server, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    done = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"]
    bad = _post(server, "/detokenize", {"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert _post(server, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    assert _post(server, "/tokenize", {"prompt": 5}).json()["error"]["param"] == "prompt"


def test_version_and_model_card(server, client):
    assert httpx.get(server.url + "/version", timeout=10).json() == {"version": __version__}
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found" and err.value.response.json()["error"]["type"]


# --- stream_options ----------------------------------------------------------------------------------------------------

def test_stream_options_need_stream(server):
    for path, body in (("/v1/completions", {"prompt": ALICE}), ("/v1/chat/completions", {"messages": CHAT})):
        r = _post(server, path, {**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": ALICE}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_continuous_usage_stats(server, path, body):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _sse(server, path, {**body, "max_tokens": 6, "temperature": 0, "stream": True, "stream_options": opts})
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)                  # every chunk carries usage
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    plain = _sse(server, path, {**body, "max_tokens": 6, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}})
    assert [c["usage"] for c in plain[:-1]] == [None] * (len(plain) - 1)
    last = {k: v for k, v in plain[-1]["usage"].items() if k != "prompt_tokens_details"}  # (a prefix-cache hit now)
    assert last == {k: v for k, v in usages[-1].items() if k != "prompt_tokens_details"}


# --- logit_bias --------------------------------------------------------------------------------------------------------

def test_logit_bias(server, client, tiny_dir):
    from orinfer.tokenizer import Tokenizer

    forced = Tokenizer.from_dir(tiny_dir).encode(" rabbit")[0]
    out = client.completions.create(model="tiny", prompt=ALICE, max_tokens=5, temperature=0,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == " rabbit" * 5
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0,
                                          logit_bias={str(forced): 100}, extra_body={"include_reasoning": False})
    assert chat.usage.completion_tokens == 3
    for bias, why in (({"999999": 1}, "not a token id"), ({"5": 100.5}, "[-100, 100]"), ({"a": 1}, "token id")):
        r = _post(server, "/v1/completions", {"prompt": ALICE, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias" and why in r.text


# --- echo and prompt logprobs ------------------------------------------------------------------------------------------

def test_echo_with_logprobs_matches_hf(server, client, tiny_dir):
    from orinfer.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(tiny_dir).encode(ALICE)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    out = client.completions.create(model="tiny", prompt=ALICE, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(ALICE) and len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for t in range(1, len(ids)):
        assert abs(lp.token_logprobs[t] - logp[t - 1, ids[t]].item()) < 2e-5
        assert len(lp.top_logprobs[t]) in (2, 3)  # the prompt token, then the 2 most likely (merged if the same)
        best = logp[t - 1].topk(2)
        for v in best.values.tolist():
            assert any(abs(v - w) < 2e-5 for w in lp.top_logprobs[t].values())
    assert "".join(lp.tokens[:len(ids)]) == ALICE and lp.text_offset[len(ids)] == len(ALICE)
    # Streaming gives the same tokens and logprobs.
    chunks = _sse(server, "/v1/completions", {"prompt": ALICE, "max_tokens": 4, "temperature": 0, "echo": True,
                                              "logprobs": 2, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice.text
    streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp.token_logprobs
    # echo without logprobs: the prompt text first.
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(ALICE) and plain.choices[0].logprobs is None


def test_max_tokens_zero_with_echo_scores_the_prompt(server, client):
    full = client.completions.create(model="tiny", prompt=ALICE, max_tokens=2, temperature=0, echo=True, logprobs=1)
    out = client.completions.create(model="tiny", prompt=ALICE, max_tokens=0, echo=True, logprobs=1)
    choice, prompt_len = out.choices[0], out.usage.prompt_tokens
    assert choice.text == ALICE and out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == full.choices[0].logprobs.token_logprobs[:prompt_len]
    chunks = _sse(server, "/v1/completions", {"prompt": ALICE, "max_tokens": 0, "echo": True, "logprobs": 1,
                                              "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == ALICE
    assert [x for c in chunks if c["choices"][0]["logprobs"]
            for x in c["choices"][0]["logprobs"]["token_logprobs"]] == choice.logprobs.token_logprobs
    r = _post(server, "/v1/completions", {"prompt": ALICE, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# --- reasoning controls ------------------------------------------------------------------------------------------------

def test_thinking_token_budget_on_chat(server, client):
    closing_answer = CLOSING_TEXT.split("</think>")[1]
    free = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0)
    assert free.choices[0].message.content and "</think>" not in free.choices[0].message.content  # never closed
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0,
                                         extra_body={"thinking_token_budget": 5})
    msg = out.choices[0].message
    assert msg.reasoning_content and msg.content is not None and out.usage.completion_tokens == 20
    # The reasoning is the first 5 tokens the model would write.
    assert free.choices[0].message.content.lstrip("\n").startswith(msg.reasoning_content)
    streamed = _sse(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 20, "temperature": 0,
                                                     "thinking_token_budget": 5, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in streamed if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg.reasoning_content
    assert "".join(d.get("content", "") for d in deltas) == msg.content
    assert closing_answer == "\n\n"
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "thinking_token_budget": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"


def test_include_reasoning_false_drops_reasoning(server, client):
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "thinking_token_budget": 3}
    full = _post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    quiet = _post(server, "/v1/chat/completions", {**body, "include_reasoning": False}).json()["choices"][0]["message"]
    assert full["reasoning_content"] and quiet["reasoning_content"] is None and quiet["content"] == full["content"]
    chunks = _sse(server, "/v1/chat/completions", {**body, "include_reasoning": False, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == full["content"]


def test_reasoning_effort_and_template_kwargs_reach_the_template(server):
    def rendered(**extra):
        ids = _post(server, "/tokenize", {"messages": history, **extra}).json()["tokens"]
        return _post(server, "/detokenize", {"tokens": ids}).json()["prompt"]

    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r1"},
               {"role": "user", "content": "c"}]
    assert "Reasoning effort is set to low" in rendered(reasoning_effort="low")
    assert "Reasoning effort is set to xhigh" in rendered()              # the template's default
    assert "r1" in rendered() and "r1" not in rendered(chat_template_kwargs={"preserve_thinking": False})
    # A value the template refuses is a 400 (the template raises), not a 500; an unknown one fails validation.
    for effort in ("high", "extreme"):
        r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "reasoning_effort": effort})
        assert r.status_code == 400
