"""Images through the OpenAI-compatible server (Qwen3-VL): the real server on 127.0.0.1 with a tiny Qwen3-VL model
(`make-tiny --arch qwen3-vl`, untrained: only the path matters), driven by the official openai client. Greedy
answers equal `LLM.chat` with the same images; every bad image is a 4xx with an OpenAI error object and the server
keeps answering; local files only below --allowed-local-media-path; a text-only model refuses images."""

from __future__ import annotations

import base64
import io
import os
import struct
import threading
import zlib

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from PIL import Image  # noqa: E402

from orinfer import LLM, SamplingParams  # noqa: E402
from orinfer.server.app import ServerLimits, build_app  # noqa: E402
from orinfer.server.cli import BackgroundServer  # noqa: E402

CHAT = "/v1/chat/completions"
STRICT_IMAGE_BYTES = 40 * 1024


def png(h: int, w: int, seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height pixels but carries almost no data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    body = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + body + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict, text: str = "Describe the picture.") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


A, B = png(90, 120, seed=1), png(200, 60, seed=2)   # 12 visual tokens each at the tiny model's 128x128 cap


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from orinfer.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3-vl-server"), arch="qwen3-vl", train_steps=0, progress=False)


def _llm(path):
    return LLM(path, dtype="float32", device="cpu", progress=False, max_model_len=512)


@pytest.fixture(scope="module")
def ref_llm(vl_dir):
    return _llm(vl_dir)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "a.png").write_bytes(A)
    (root / "secret.png").write_bytes(B)
    os.symlink(root / "secret.png", root / "allowed" / "link.png")
    return root


@pytest.fixture(scope="module")
def server(vl_dir):
    with BackgroundServer(build_app(_llm(vl_dir), "vl")) as bg:
        yield bg


@pytest.fixture(scope="module")
def strict_server(vl_dir, media_dir):
    limits = ServerLimits(max_image_bytes=STRICT_IMAGE_BYTES, allowed_local_media_path=str(media_dir / "allowed"))
    with BackgroundServer(build_app(_llm(vl_dir), "vl", limits=limits)) as bg:
        yield bg


def _client(bg):
    return openai.OpenAI(base_url=bg.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server):
    with _client(server) as c:
        yield c


def _reference(ref_llm, messages, max_tokens=8, **fields):
    return ref_llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0, **fields))[0]


def _ask(client, messages, max_tokens=8, **kwargs):
    return client.chat.completions.create(model="vl", messages=messages, max_tokens=max_tokens, temperature=0,
                                          **kwargs)


# --- images that work ----------------------------------------------------------------------------------------------

def test_one_image_equals_llm_chat(client, ref_llm):
    messages = user(image_part(data_url(A)))
    out, ref = _ask(client, messages), _reference(ref_llm, messages)
    assert out.choices[0].message.content == ref.text and ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)      # the visual tokens are counted
    assert out.usage.completion_tokens == len(ref.token_ids) == 8


def test_two_images_and_text_only(client, ref_llm):
    two = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": [image_part(data_url(A)), {"type": "text", "text": "versus"},
                                        image_part(data_url(B, "image/PNG"))]}]
    out, ref = _ask(client, two), _reference(ref_llm, two)
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    one = _ask(client, user(image_part(data_url(A))))
    assert out.usage.prompt_tokens > one.usage.prompt_tokens + 12   # 12 more visual tokens, and more text
    for messages in ([{"role": "user", "content": "Who is Alice?"}], user(text="Who is Alice?")):
        text_only, ref = _ask(client, messages), _reference(ref_llm, messages)
        assert text_only.choices[0].message.content == ref.text
        assert text_only.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_stream_with_image(client):
    messages = user(image_part(data_url(B)))
    full = _ask(client, messages, max_tokens=10)
    chunks = list(_ask(client, messages, max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_large_image_within_the_body_limit(client, ref_llm):
    big = png(1000, 800, seed=3)  # noise does not compress: ~2.4 MB, ~3.2 MB of base64, under the 4 MiB body limit
    assert 2_000_000 < len(big) and len(data_url(big)) < ServerLimits().max_body_bytes - 10_000
    messages = user(image_part(data_url(big)))
    out = _ask(client, messages, max_tokens=4)
    assert out.choices[0].message.content == _reference(ref_llm, messages, max_tokens=4).text


def test_request_max_pixels(client, ref_llm):
    messages = user(image_part(data_url(B)))
    small = _ask(client, messages, extra_body={"mm_processor_kwargs": {"max_pixels": 32 * 64}})
    default = _ask(client, messages)
    assert small.usage.prompt_tokens < default.usage.prompt_tokens
    ref = ref_llm.generate({"prompt": ref_llm.render_chat(messages), "multi_modal_data": {"image": [B]},
                            "mm_processor_kwargs": {"max_pixels": 32 * 64}},
                           SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert small.choices[0].message.content == ref.text
    assert small.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_the_engine_reads_no_local_files(server):
    assert server.server.config.app.state.server.engine.allow_local_files is False


def test_images_are_decoded_off_the_event_loop(server, client, monkeypatch):
    loader = server.server.config.app.state.server.images
    threads = []
    load_all = loader._load_all

    def spy(*args):
        threads.append(threading.get_ident())
        return load_all(*args)

    monkeypatch.setattr(loader, "_load_all", spy)
    assert _ask(client, user(image_part(data_url(A)))).choices[0].message.content
    assert threads and threads[0] != server._thread.ident  # a worker thread, not the event loop's


# --- images that do not ------------------------------------------------------------------------------------------

def _body(messages, **fields):
    return {"model": "vl", "messages": messages, "max_tokens": 4, **fields}


def _assert_openai_error(r, status=400, code=None):
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code, err
    return err


truncated = A[: len(A) // 2]
BAD = [
    ("corrupt base64", user(image_part("data:image/png;base64,@@not base64!!")), "invalid_image", "base64"),
    ("not an image", user(image_part(data_url(b"just some text, not a picture"))), "invalid_image", "not an image"),
    ("empty image", user(image_part("data:image/png;base64,")), "invalid_image", "empty"),
    ("zero-size image", user(image_part(data_url(png_header(0, 0)))), "invalid_image", None),
    ("truncated image", user(image_part(data_url(truncated))), "invalid_image", "truncated"),
    ("decompression bomb", user(image_part(data_url(png_header(100_000, 100_000)))), "invalid_image", "too large"),
    ("extreme aspect ratio", user(image_part(data_url(png(2, 500)))), "invalid_image", "aspect ratio"),
    ("not image media type", user(image_part("data:text/plain;base64,aGVsbG8=")), "invalid_image", "image/"),
    ("too many images", user(*[image_part(data_url(A))] * 9), "too_many_images", "limit is 8"),
    ("http URL", user(image_part("http://169.254.169.254/latest/x.png")), "image_url_not_supported", "network"),
    ("https URL", user(image_part("https://example.com/cat.png")), "image_url_not_supported", "network"),
    ("ftp URL", user(image_part("ftp://example.com/cat.png")), "image_url_not_supported", "scheme"),
    ("local path", user(image_part("/etc/hostname")), "local_files_not_allowed", "local"),
    ("file URL", user(image_part("file:///etc/hostname")), "local_files_not_allowed", "local"),
    ("image part without url", user({"type": "image_url", "image_url": {"url": ""}}), None, "image_url.url"),
    ("video part", user({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}), None, "video"),
]


@pytest.mark.parametrize("name,messages,code,words", BAD, ids=[b[0] for b in BAD])
def test_bad_images(server, name, messages, code, words):
    r = httpx.post(server.url + CHAT, json=_body(messages), timeout=30)
    err = _assert_openai_error(r, 400, code)
    assert err["param"] and err["param"].startswith("messages"), err
    if words:
        assert words in err["message"], err["message"]


@pytest.mark.parametrize("value", [10 ** 9, 1, 0, "many", 2 ** 70])
def test_bad_max_pixels(server, value):
    body = _body(user(image_part(data_url(A))), mm_processor_kwargs={"max_pixels": value})
    _assert_openai_error(httpx.post(server.url + CHAT, json=body, timeout=30), 400)
    body["mm_processor_kwargs"] = {"min_pixels": 5}
    _assert_openai_error(httpx.post(server.url + CHAT, json=body, timeout=30), 400)


def test_server_keeps_answering_after_bad_images(server, client, ref_llm):
    for _, messages, _, _ in BAD:
        assert 400 <= httpx.post(server.url + CHAT, json=_body(messages), timeout=30).status_code < 500
    messages = user(image_part(data_url(A)))
    assert _ask(client, messages).choices[0].message.content == _reference(ref_llm, messages).text
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    # (the message names each route's status counts: a 500 here is otherwise hard to trace to its request)
    assert 'code="500"' not in metrics and "orinfer_num_requests_running 0" in metrics, \
        [line for line in metrics.splitlines() if line.startswith("orinfer_http_requests_total{")]


# --- limits and local files (a second server: small image limit, --allowed-local-media-path) ---------------------------

def test_oversized_image_bytes(strict_server):
    small, large = png(8, 8), png(150, 150)
    assert len(small) < STRICT_IMAGE_BYTES < len(large)
    r = httpx.post(strict_server.url + CHAT, json=_body(user(image_part(data_url(large)))), timeout=30)
    assert "too large" in _assert_openai_error(r, 400, "invalid_image")["message"]
    assert httpx.post(strict_server.url + CHAT, json=_body(user(image_part(data_url(small)))),
                      timeout=30).status_code == 200


def test_local_files_only_below_the_allowed_path(strict_server, media_dir, ref_llm):
    allowed = media_dir / "allowed" / "a.png"
    assert len(A) < STRICT_IMAGE_BYTES
    reference = _reference(ref_llm, user(image_part(data_url(A)))).text
    with _client(strict_server) as c:
        for url in (str(allowed), allowed.as_uri()):   # a path and a file:// URL: the same picture as the data URL
            assert _ask(c, user(image_part(url))).choices[0].message.content == reference
    refused = [str(media_dir / "secret.png"),                   # outside
               str(media_dir / "allowed" / ".." / "secret.png"),  # outside, through ..
               str(media_dir / "allowed" / "link.png"),         # a symlink inside that points outside
               "allowed/a.png",                                 # relative
               "file://otherhost" + str(allowed)]               # another host
    for url in refused:
        r = httpx.post(strict_server.url + CHAT, json=_body(user(image_part(url))), timeout=30)
        _assert_openai_error(r, 400)
    r = httpx.post(strict_server.url + CHAT, json=_body(user(image_part(str(media_dir / "allowed" / "no.png")))),
                   timeout=30)
    assert "not found" in _assert_openai_error(r, 400, "invalid_image")["message"]


def test_text_only_model_refuses_images(tmp_path):
    from orinfer.tiny import make_tiny

    llm = _llm(make_tiny(tmp_path / "tiny-qwen3", arch="qwen3", train_steps=0, progress=False))
    with BackgroundServer(build_app(llm, "tiny")) as bg, httpx.Client(base_url=bg.url, timeout=30) as http:
        body = {"model": "tiny", "messages": user(image_part(data_url(A))), "max_tokens": 4}
        err = _assert_openai_error(http.post(CHAT, json=body), 400, "image_input_not_supported")
        assert "takes no images" in err["message"] and err["param"] == "messages.0.content.0"
        body["messages"] = user(text="Who is Alice?")
        assert http.post(CHAT, json=body).status_code == 200


def test_serve_image_flags():
    import argparse

    from orinfer.server.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="orinfer")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", "-m", "d"])
    assert (args.max_images_per_request, args.max_image_bytes, args.allowed_local_media_path) == (8, 20 << 20, None)
    args = parser.parse_args(["serve", "-m", "d", "--allowed-local-media-path", "/srv/img", "--max-image-bytes", "99",
                              "--max-images-per-request", "2", "--max-pixels", "4096"])
    assert (args.allowed_local_media_path, args.max_image_bytes, args.max_images_per_request, args.max_pixels) == \
        ("/srv/img", 99, 2, 4096)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "-m", "d", "--max-image-bytes", "0"])


def test_decoded_pixels_of_a_request_are_bounded(vl_dir):
    """Each image fits the per-image limit, but together they do not fit the request's: the image that would cross it
    is refused before it is decoded, naming the request budget; the same images in separate requests are served."""
    limits = ServerLimits(max_request_image_pixels=60 * 60)
    with BackgroundServer(build_app(_llm(vl_dir), "vl", limits=limits)) as bg:
        two = user(image_part(data_url(png(50, 50, seed=1))), image_part(data_url(png(50, 50, seed=2))))
        r = httpx.post(bg.url + "/v1/chat/completions", json=_body(two), timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "3600 decoded pixels in all (2500 taken by the ones before it)" in err["message"]
        assert err["param"] == "messages.0.content.1"
        one = user(image_part(data_url(png(50, 50, seed=1))))
        assert httpx.post(bg.url + "/v1/chat/completions", json=_body(one), timeout=60).status_code == 200


def test_heap_is_trimmed_after_large_decodes(vl_dir, monkeypatch):
    """glibc keeps freed arenas: after a request whose images decode to more than TRIM_AFTER_PIXELS the loader hands
    the free heap back (RSS had stayed ~340 MB up after four requests of two 16-Mpx PNGs); small images do not pay."""
    import orinfer.server.images as images
    from orinfer.server.memory import release_freed_memory

    assert release_freed_memory() is True  # glibc: the call exists and runs
    calls = []
    monkeypatch.setattr(images, "release_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(images.ImageLoader, "TRIM_AFTER_PIXELS", 60 * 60)
    with BackgroundServer(build_app(_llm(vl_dir), "vl")) as bg:
        small = user(image_part(data_url(png(50, 50, seed=1))))
        assert httpx.post(bg.url + "/v1/chat/completions", json=_body(small), timeout=60).status_code == 200
        assert calls == []
        large = user(image_part(data_url(png(50, 50, seed=1))), image_part(data_url(png(40, 40, seed=2))))
        assert httpx.post(bg.url + "/v1/chat/completions", json=_body(large), timeout=60).status_code == 200
        assert calls == [1]
