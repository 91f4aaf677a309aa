"""Streaming under load: updates that queue up while a stream is busy are merged into one chunk per sequence
(`RequestGroup.updates`), and the merged stream says exactly what the non-streaming answer says, also with 8 streams
at once against the real server."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from orinfer import LLM, SamplingParams  # noqa: E402
from orinfer.engine.sequence import TokenLogprob  # noqa: E402
from orinfer.server.app import build_app  # noqa: E402
from orinfer.server.chat import chat_stream  # noqa: E402
from orinfer.server.cli import BackgroundServer  # noqa: E402
from orinfer.server.engine_loop import EngineStepError, RequestGroup, SeqUpdate  # noqa: E402
from orinfer.reasoning import ThinkState  # noqa: E402


def _group(n: int) -> RequestGroup:
    return RequestGroup("req", [[1]] * n, [SamplingParams() for _ in range(n)])


def test_queued_updates_are_merged_per_sequence():
    async def run():
        group = _group(2)
        lp = [TokenLogprob(i, -float(i)) for i in range(4)]
        for up in [SeqUpdate(0, "a", [lp[0]], 1, None), SeqUpdate(1, "x", [lp[1]], 1, None),
                   SeqUpdate(0, "b", [lp[2]], 2, None), SeqUpdate(0, "c", [lp[3]], 3, "stop")]:
            group.queue.put_nowait(up)
        seen = []
        async for up in group.updates():
            seen.append(up)
            if len(seen) == 2:  # sequence 1 is still running: its last update comes later
                group.queue.put_nowait(SeqUpdate(1, "y", [], 2, "length"))
        assert group.done
        return seen

    seen = asyncio.run(asyncio.wait_for(run(), 10))
    assert [(u.index, u.text, u.num_completion_tokens, u.finish_reason) for u in seen] == \
        [(0, "abc", 3, "stop"), (1, "x", 1, None), (1, "y", 2, "length")]
    assert [lp.token_id for lp in seen[0].logprobs] == [0, 2, 3]


def test_updates_before_an_error_still_arrive():
    async def run():
        group = _group(1)
        group.queue.put_nowait(SeqUpdate(0, "a", [], 1, None))
        group.queue.put_nowait(SeqUpdate(0, "b", [], 2, None))
        group.queue.put_nowait(EngineStepError("boom"))
        seen = []
        with pytest.raises(EngineStepError):
            async for up in group.updates():
                seen.append(up.text)
        return seen

    assert asyncio.run(asyncio.wait_for(run(), 10)) == ["ab"]


class _Srv:
    name = "m"

    def chat_logprobs(self, lps):
        from orinfer.server.protocol import ChatLogprobs, TokenLogprobEntry

        return ChatLogprobs(content=[TokenLogprobEntry(token=str(lp.token_id), logprob=lp.logprob) for lp in lps])


def test_a_backlog_becomes_one_chunk():
    """Twenty tokens queued before the stream runs: one content chunk with all the text and all the logprobs, then
    the finish chunk and the usage chunk, in the OpenAI chunk format."""
    async def run():
        group = _group(1)
        for i in range(20):
            reason = "length" if i == 19 else None
            group.queue.put_nowait(SeqUpdate(0, f"t{i} ", [TokenLogprob(i, -0.5)], i + 1, reason))
        return [e async for e in chat_stream(_Srv(), group, "id", 7, 1, 3, ThinkState.CONTENT, True, True)]

    events = asyncio.run(asyncio.wait_for(run(), 10))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "id" and c["created"] == 7 for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": "".join(f"t{i} " for i in range(20))}, {}]
    assert [e["token"] for e in chunks[1]["choices"][0]["logprobs"]["content"]] == [str(i) for i in range(20)]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 20,
                                                                  "total_tokens": 23,
                                                                  "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.fixture(scope="module")
def server(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_model_len=512)
    with BackgroundServer(build_app(llm, "tiny")) as bg:
        yield bg


PROMPTS = ["Alice was beginning to get very", "The Queen", "Down, down, down.", "White Rabbit", "Curiouser",
           "the Hatter", "Dinah", "Off with her head"]


def test_concurrent_streams_say_what_the_plain_answers_say(server):
    common = dict(model="tiny", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as ac:
            async def chat(p, stream):
                return await ac.chat.completions.create(messages=[{"role": "user", "content": p}], logprobs=True,
                                                        stream=stream, **common)

            async def comp(p, stream):
                return await ac.completions.create(prompt=p, n=2, stream=stream, **common)

            def call(k, stream):
                return (chat if k % 2 == 0 else comp)(PROMPTS[k], stream)

            plain = await asyncio.gather(*[call(k, False) for k in range(8)])

            async def read(k):
                return [c async for c in await call(k, True)]

            streamed = await asyncio.gather(*[read(k) for k in range(8)])
        return plain, streamed

    plain, streamed = asyncio.run(asyncio.wait_for(run(), 120))
    for k, (full, chunks) in enumerate(zip(plain, streamed)):
        if k % 2 == 0:
            msg = full.choices[0].message
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == msg.content and text, k
            tokens = [e.token for c in chunks if c.choices and c.choices[0].logprobs
                      for e in c.choices[0].logprobs.content]
            assert tokens == [e.token for e in full.choices[0].logprobs.content] and len(tokens) == 24
        else:
            for i in range(2):
                text = "".join(ch.text for c in chunks for ch in c.choices if ch.index == i)
                assert text == full.choices[i].text, (k, i)
        finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
        assert finishes == ["length"] * len(full.choices)


def test_streams_catch_up_after_a_stalled_event_loop(server, monkeypatch):
    """The server's event loop is stalled now and then (as by a burst of other work) while the engine thread keeps
    stepping: the updates that pile up go out merged - fewer chunks than tokens - and the text is still exact."""
    state = server.server.config.app.state.server
    loops: list[asyncio.AbstractEventLoop] = []
    submit = state.loop.submit

    def capture(group):
        loops.append(group.loop)
        submit(group)

    monkeypatch.setattr(state.loop, "submit", capture)
    running = threading.Event()
    running.set()

    def stall():
        while running.is_set():
            if loops:
                loops[0].call_soon_threadsafe(time.sleep, 0.04)
            time.sleep(0.1)

    common = dict(model="tiny", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as ac:
            async def read(p):
                return [c async for c in await ac.completions.create(prompt=p, stream=True, **common)]

            plain = [(await ac.completions.create(prompt=p, **common)).choices[0].text for p in PROMPTS[:4]]
            staller = threading.Thread(target=stall, daemon=True)
            staller.start()
            try:
                streamed = await asyncio.gather(*[read(p) for p in PROMPTS[:4]])
            finally:
                running.clear()
                staller.join()
        return plain, streamed

    plain, streamed = asyncio.run(asyncio.wait_for(run(), 120))
    for text, chunks in zip(plain, streamed):
        assert "".join(c.choices[0].text for c in chunks) == text
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert sum(len(chunks) for chunks in streamed) < 4 * 32  # some chunks carried several tokens
