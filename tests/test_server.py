"""The OpenAI-compatible server (`orinfer serve`): the real server on 127.0.0.1, driven by the official openai client,
plus the Qwen3 reasoning split on crafted text and a cancellation storm that must leave no KV block behind."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from orinfer import LLM  # noqa: E402
from orinfer.engine.sequence import TokenLogprob  # noqa: E402
from orinfer.server.app import ServerLimits, build_app  # noqa: E402
from orinfer.server.chat import chat_stream  # noqa: E402
from orinfer.server.cli import BackgroundServer  # noqa: E402
from orinfer.server.engine_loop import SeqUpdate  # noqa: E402
from orinfer.reasoning import ReasoningParser, ThinkState, initial_state, split_reasoning  # noqa: E402

ALICE = "Alice was beginning to get very"
MAX_TOKENS_CAP = 64


@pytest.fixture(scope="module")
def server(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False)
    app = build_app(llm, "tiny", limits=ServerLimits(max_tokens=MAX_TOKENS_CAP))
    with BackgroundServer(app) as bg:
        yield bg


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


# --- basics ------------------------------------------------------------------------------------------------------------

def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_continues_alice(client):
    out = client.completions.create(model="tiny", prompt=ALICE, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.text.startswith(" tired of sitting by her sister")
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_token_ids_and_batch_of_prompts(client):
    ids_out = client.completions.create(model="tiny", prompt=ALICE, max_tokens=6, temperature=0)
    prompts = [ALICE, "Down, down, down."]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == ids_out.choices[0].text  # greedy: both choices agree
    assert out.usage.completion_tokens == 4 * 6


def test_chat_and_stream_agree(client):
    msgs = _chat("Who is Alice?")
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0)
    msg = full.choices[0].message
    assert isinstance(msg.content, str) and msg.content.strip()
    assert full.choices[0].finish_reason in ("length", "stop")
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_completion_stream_agrees(client):
    full = client.completions.create(model="tiny", prompt=ALICE, max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=ALICE, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_thinking_switches(client):
    msgs = _chat("Who is Alice?")
    off = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = client.chat.completions.create(model="tiny", messages=_chat("Who is Alice? /no_think"), max_tokens=16,
                                        temperature=0)
    for out in (off, on):
        msg = out.choices[0].message
        assert msg.content  # never an empty answer: the tiny model does not think, so all of it is content
        assert getattr(msg, "reasoning_content", None) is None
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, stream=True,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == off.choices[0].message.content


def test_text_parts_are_concatenated_like_llm_chat(client):
    parts = [{"type": "text", "text": "Who is "}, {"type": "text", "text": "Alice?"}]
    split = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                           max_tokens=8, temperature=0)
    whole = client.chat.completions.create(model="tiny", messages=_chat("Who is Alice?"), max_tokens=8, temperature=0)
    assert split.usage.prompt_tokens == whole.usage.prompt_tokens
    assert split.choices[0].message.content == whole.choices[0].message.content


def test_stop_strings(client):
    out = client.completions.create(model="tiny", prompt=ALICE, max_tokens=12, temperature=0, stop=[" sister"])
    assert out.choices[0].text == " tired of sitting by her"
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=ALICE, max_tokens=12, temperature=0,
                                            stop=" sister", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " tired of sitting by her"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible_and_n(client):
    def run(seed, n=1):
        return client.completions.create(model="tiny", prompt="Alice", max_tokens=16, temperature=1.0, top_p=1.0,
                                         seed=seed, n=n)

    a, b = run(1234), run(1234)
    assert a.choices[0].text == b.choices[0].text
    texts = {run(s).choices[0].text for s in range(1, 5)}
    assert len(texts) > 1  # different seeds, different samples
    both = run(1234, n=2)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == a.choices[0].text          # choice 0 uses the seed
    assert both.choices[1].text == run(1235).choices[0].text  # choice i uses seed + i
    chat = client.chat.completions.create(model="tiny", messages=_chat("Alice"), max_tokens=8, n=2, seed=7)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)
    assert chat.usage.completion_tokens <= 16


def test_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=_chat("Alice"), max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.logprob <= 0 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)  # greedy: top-1
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    comp = client.completions.create(model="tiny", prompt=ALICE, max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)
    chunks = list(client.chat.completions.create(model="tiny", messages=_chat("Alice"), max_tokens=6, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_default_max_tokens_is_capped(client):
    out = client.chat.completions.create(model="tiny", messages=_chat("Tell me everything."), temperature=1.0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == MAX_TOKENS_CAP and out.choices[0].finish_reason == "length"


def test_concurrent_requests_match_sequential(server, client):
    prompts = ["Alice", "The Queen", "Down, down, down.", "White Rabbit", ALICE, "Curiouser", "the Hatter", "Dinah"]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0).choices[0].text
             for p in prompts]

    async def together():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as ac:
            outs = await asyncio.gather(*[ac.completions.create(model="tiny", prompt=p, max_tokens=10,
                                                                  temperature=0) for p in prompts])
        return [o.choices[0].text for o in outs]

    assert asyncio.run(asyncio.wait_for(together(), 60)) == alone


def test_metrics_page(server, client):
    before = _metrics(server)
    client.completions.create(model="tiny", prompt=ALICE, max_tokens=4, temperature=0)
    after = _metrics(server)
    assert after["orinfer_generation_tokens_total"] - before.get("orinfer_generation_tokens_total", 0) == 4
    assert after["orinfer_time_to_first_token_seconds_count"] > before.get(
        "orinfer_time_to_first_token_seconds_count", 0)
    def grew(name: str) -> float:
        return after[f"orinfer_{name}"] - before.get(f"orinfer_{name}", 0)

    queue_sum, ttft_sum = grew("request_queue_time_seconds_sum"), grew("time_to_first_token_seconds_sum")
    assert grew("request_queue_time_seconds_count") == 1 and 0 <= queue_sum <= ttft_sum  # admission, then a token
    # The engine's step totals and the processes' CPU time (what the serving bench reads to place a bottleneck).
    assert grew("engine_steps_total") >= 4 and 0 < grew("engine_step_seconds_total")
    assert after["orinfer_engine_cpu_seconds_total"] > 0 and after["process_cpu_seconds_total"] > 0
    for name in ("orinfer_num_requests_running", "orinfer_num_requests_waiting", "orinfer_kv_cache_usage_perc",
                 "orinfer_time_per_output_token_seconds_count", "orinfer_prompt_tokens_total"):
        assert name in after
    assert after['orinfer_http_requests_total{code="200",route="/v1/completions"}'] >= 1
    # A prompt of several KV blocks, twice: the second finds the first's computed full blocks in the prefix cache.
    long = " ".join([ALICE] * 8)
    client.completions.create(model="tiny", prompt=long, max_tokens=4, temperature=0)
    after = _metrics(server)
    client.completions.create(model="tiny", prompt=long, max_tokens=4, temperature=0)
    again = _metrics(server)
    queried = again["orinfer_prefix_cache_queries_total"] - after["orinfer_prefix_cache_queries_total"]
    hits = again["orinfer_prefix_cache_hits_total"] - after["orinfer_prefix_cache_hits_total"]
    assert queried > 0 and 0 < hits < queried


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(client):
    """usage.prompt_tokens_details.cached_tokens, as OpenAI reports it: 0 the first time, whole cached blocks when the
    same long prompt comes again, in chat and completions, streamed (with include_usage) or not."""
    long = " ".join(["The Queen of Hearts, she made some tarts."] * 6)
    messages = [{"role": "user", "content": long}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    assert [c.usage for c in stream if c.usage][0].prompt_tokens_details.cached_tokens == cached
    for _ in range(2):  # the second time, each of the two prompts finds its blocks; each counts once, not n times
        two = client.completions.create(model="tiny", prompt=[long, long + " Alice"], n=2, max_tokens=2,
                                        temperature=0)
    assert 0 < two.usage.prompt_tokens_details.cached_tokens <= two.usage.prompt_tokens


def test_serve_subcommand_parses():
    import argparse

    from orinfer.server.cli import add_serve_parser, run_serve

    parser = argparse.ArgumentParser(prog="orinfer")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", "-m", "some/dir", "--dtype", "float32", "--max-n", "4"])
    assert (args.host, args.port, args.func, args.max_n, args.dtype) == ("127.0.0.1", 8000, run_serve, 4, "float32")
    assert args.served_model_name is None and args.reasoning_parser == "auto"


# --- cancellation ----------------------------------------------------------------------------------------------------

def test_cancelled_requests_free_their_kv_blocks(server):
    """200 requests cancelled at random points (closing the stream after a few chunks, cancelling the task, or a
    client timeout on a non-streaming request), 16 at a time: afterwards nothing runs or waits, every KV block is free
    and a normal request still works."""

    async def storm() -> None:
        rng = random.Random(0)
        sem = asyncio.Semaphore(16)
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as http:
            async def read_some(body: dict, path: str, chunks: int) -> None:
                async with http.stream("POST", path, json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data:")
                        if seen >= chunks:
                            break

            async def one(k: int) -> None:
                async with sem:
                    chat = k % 2 == 0
                    path = "/v1/chat/completions" if chat else "/v1/completions"
                    body = {"max_tokens": 40, "temperature": 1.0, "ignore_eos": True, "stream": True}
                    body.update({"messages": _chat(f"Alice {k}")} if chat else {"prompt": f"Alice {k}"})
                    mode = k % 6
                    try:
                        if mode in (0, 1, 2):    # read a few chunks, then close the connection
                            await read_some(body, path, rng.randint(1, 8))
                        elif mode == 5:          # some run to the end
                            await read_some(body, path, 10_000)
                        elif mode == 3:          # cancel the task at a random moment
                            task = asyncio.ensure_future(read_some(body, path, 10_000))
                            await asyncio.sleep(rng.uniform(0.0, 0.05))
                            task.cancel()
                            await asyncio.gather(task, return_exceptions=True)
                        else:                    # non-streaming, the client gives up
                            body["stream"] = False
                            await http.post(path, json=body, timeout=rng.uniform(0.005, 0.05))
                    except (httpx.TimeoutException, httpx.TransportError):
                        pass

            await asyncio.gather(*[one(k) for k in range(200)])

    start = time.monotonic()
    asyncio.run(asyncio.wait_for(storm(), 120))
    deadline = time.monotonic() + 15
    while True:  # the engine thread handles aborts between steps: give it a moment
        m = _metrics(server)
        idle = (m["orinfer_num_requests_running"] == 0 and m["orinfer_num_requests_waiting"] == 0
                and m["orinfer_kv_cache_free_blocks"] == m["orinfer_kv_cache_total_blocks"])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, m
    assert m['orinfer_request_success_total{finish_reason="abort"}'] > 0
    assert m['orinfer_request_success_total{finish_reason="length"}'] > 0
    assert m["orinfer_kv_cache_usage_perc"] == 0
    engine = server.server.config.app.state.server.engine
    assert not engine.sequences and not engine.has_unfinished()
    out = httpx.post(server.url + "/v1/completions", json={"prompt": ALICE, "max_tokens": 12, "temperature": 0},
                     timeout=30).json()
    assert out["choices"][0]["text"].startswith(" tired of sitting")
    assert time.monotonic() - start < 90


# --- the reasoning split ---------------------------------------------------------------------------------------------

S, T, C = ThinkState.START, ThinkState.THINKING, ThinkState.CONTENT
SPLIT_CASES = [
    ("<think>\nI think.\n</think>\n\nAnswer.", S, "I think.", "Answer."),
    ("Answer only.", S, None, "Answer only."),
    ("", S, None, ""),
    ("<think>\n\n</think>\n\nHi", S, None, "Hi"),                       # the /no_think soft switch
    ("reasoning\n</think>\n\nAnswer", T, "reasoning", "Answer"),          # <think> was in the prompt
    ("Answer </think> x", C, None, "Answer </think> x"),                 # thinking disabled: nothing parsed
    ("Answer </think> more", S, None, "Answer </think> more"),           # no opening tag: all content
    ("  \n<think>a</think>b", S, "a", "b"),
    ("<think>a\n\nb\n</think>c\n\nd", S, "a\n\nb", "c\n\nd"),
    ("<thinking>x", S, None, "<thinking>x"),
    ("<think", S, None, "<think"),
    ("<think>a<think>b</think>c", S, "a<think>b", "c"),
    ("<think>日本\n</think>語", S, "日本", "語"),
    ("<think>x</think>", S, "x", ""),
    ("\n\n", S, None, "\n\n"),
]
UNTERMINATED = [
    ("<think>\nthinking forever\n", S, "thinking forever\n"),
    ("<think>almost</thi", S, "almost</thi"),
    ("still thinking", T, "still thinking"),
]


def _chunkings(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 5)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def _stream(chunks: list[str], state: ThinkState) -> tuple[str, str]:
    parser = ReasoningParser(state)
    reasoning, content = "", ""
    for chunk in chunks:
        part = parser.feed(chunk)
        reasoning, content = reasoning + part.reasoning, content + part.content
    part = parser.finish()
    return reasoning + part.reasoning, content + part.content


@pytest.mark.parametrize("text,state,reasoning,content", SPLIT_CASES)
def test_reasoning_split(text, state, reasoning, content):
    assert split_reasoning(text, state) == (reasoning, content)
    for chunks in _chunkings(text, seed=len(text)):
        assert _stream(chunks, state) == (reasoning or "", content), chunks


@pytest.mark.parametrize("text,state,streamed_reasoning", UNTERMINATED)
def test_reasoning_unterminated(text, state, streamed_reasoning):
    # Non-streaming: never an empty answer, the raw output is the content (as vLLM). Streaming: already reasoning.
    assert split_reasoning(text, state) == (None, text)
    for chunks in _chunkings(text, seed=3):
        assert _stream(chunks, state) == (streamed_reasoning, "")


def test_initial_state_from_rendered_prompts(tiny_dir):
    from orinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_dir)
    msgs = _chat("hi")
    assert initial_state(tok.apply_chat_template(msgs)) is ThinkState.START
    assert initial_state(tok.apply_chat_template(msgs, enable_thinking=False)) is ThinkState.CONTENT
    assert initial_state("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n") is ThinkState.THINKING
    # A <think> written by the user is not the assistant's.
    assert initial_state(tok.apply_chat_template(_chat("<think>"))) is ThinkState.START


class _FakeGroup:
    def __init__(self, updates):
        self._updates, self.aborted = updates, False

    async def updates(self):
        for u in self._updates:
            yield u

    def abort(self):
        self.aborted = True


class _FakeServer:
    name = "fake"

    def chat_logprobs(self, lps):
        from orinfer.server.protocol import ChatLogprobs, TokenLogprobEntry

        return ChatLogprobs(content=[TokenLogprobEntry(token=str(lp.token_id), logprob=lp.logprob) for lp in lps])


def _run_chat_stream(updates, n, state, include_usage=False, logprobs=False):
    async def run():
        group = _FakeGroup(updates)
        events = [e async for e in chat_stream(_FakeServer(), group, "id", 0, n, 5, state, include_usage, logprobs)]
        assert group.aborted  # the stream always aborts on the way out (a no-op when finished)
        return events

    events = asyncio.run(asyncio.wait_for(run(), 10))
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def test_chat_stream_reasoning_fields():
    pieces = ["<th", "ink>\nI", " ponder\n</", "think>\n\nThe answer", "."]
    updates = [SeqUpdate(0, p, [TokenLogprob(i, -0.5)], i + 1, None) for i, p in enumerate(pieces)]
    updates.append(SeqUpdate(0, "", [], 6, "stop"))
    chunks = _run_chat_stream(updates, 1, ThinkState.START, include_usage=True, logprobs=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I ponder"
    assert "".join(d.get("content", "") for d in deltas) == "The answer."
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 6,
                                                                    "total_tokens": 11,
                                                                    "prompt_tokens_details": {"cached_tokens": 0}}
    sent = [e["token"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
            for e in c["choices"][0]["logprobs"]["content"]]
    assert sent == ["0", "1", "2", "3", "4"]  # every token's logprob, once, even when its text was held back
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def test_chat_stream_two_choices_interleaved():
    updates = [SeqUpdate(0, "<think>a", [], 1, None), SeqUpdate(1, "plain", [], 1, None),
               SeqUpdate(0, "</think>b", [], 2, "stop"), SeqUpdate(1, " text", [], 2, "length")]
    chunks = _run_chat_stream(updates, 2, ThinkState.START)
    by_index: dict[int, dict[str, str]] = {0: {}, 1: {}}
    for c in chunks:
        for ch in c["choices"]:
            for key, value in ch["delta"].items():
                if key != "role":
                    by_index[ch["index"]][key] = by_index[ch["index"]].get(key, "") + value
    assert by_index[0] == {"content": "b", "reasoning_content": "a"}
    assert by_index[1] == {"content": "plain text"}
