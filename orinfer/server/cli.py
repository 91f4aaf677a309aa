"""`orinfer serve -m DIR`: the OpenAI-compatible server (FastAPI + uvicorn), on 127.0.0.1:8000 by default.

This module imports neither FastAPI nor uvicorn at import time, so `orinfer --help` works without the `serve` extra.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import os
import sys
import threading
import time
from typing import Any

log = logging.getLogger("orinfer.serve")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from orinfer.cli import _add_model_args  # the same model options as `generate`

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("ORINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $ORINFER_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the -m value)")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "qwen3", "none"],
                   help="split <think> output into reasoning_content (auto: when the tokenizer has the tags)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body (413 beyond)")
    p.add_argument("--max-body-values", type=_positive_int, default=None,
                   help="JSON values in a request body, array items and object members (413 beyond; default "
                        "65,536, or the context length + 4,096 if more)")
    p.add_argument("--max-header-bytes", type=int, default=64 * 1024, help="largest request head (431 beyond)")
    p.add_argument("--max-n", type=int, default=16, help="largest n (choices per prompt)")
    p.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: the context length)")
    p.add_argument("--max-pending", type=int, default=4096,
                   help="sequences running or queued before new requests get 429 (retry later); a request of "
                        "more sequences than this alone (prompts x n) gets 400")
    p.add_argument("--request-read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request's head and body must arrive within this; slower connections are closed")
    p.add_argument("--max-connections", type=_positive_int, default=1024,
                   help="open connections at most; the one that reaches it gets 503 (default 1024)")
    img = p.add_argument_group("images (Qwen3-VL models)")
    img.add_argument("--max-images-per-request", type=_positive_int, default=8,
                     help="images in one chat request (default 8)")
    img.add_argument("--max-image-bytes", type=_positive_int, default=20 * 1024 * 1024,
                     help="encoded size of one image, after base64 decoding (default 20 MiB; the body limit, "
                          "--max-body-bytes, must leave room for the base64 text)")
    img.add_argument("--max-image-pixels", type=_positive_int, default=64 * 1024 * 1024,
                     help="decoded size of one image before resizing, width x height (default 64 Mpx)")
    img.add_argument("--max-request-image-pixels", type=_positive_int, default=64 * 1024 * 1024,
                     help="decoded size of all images of one request together, before resizing (default 64 Mpx)")
    img.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                     help="let requests name local image files (file:// URLs or absolute paths) below DIR; without "
                          "it only data: URLs are accepted. Anyone who can reach the server can then read images "
                          "below DIR")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a child process, so that HTTP handling never waits for the engine's Python "
                        "work (--no-engine-process: a thread of the server process)")
    p.add_argument("--uvicorn-log-level", default="info")
    p.set_defaults(func=run_serve)
    return p


# The Host names a loopback server without an API key answers to (anything else is a DNS-rebinding attempt).
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_limits(args: argparse.Namespace) -> Any:
    """The ServerLimits of `orinfer serve`'s options. A loopback server without an API key answers only to loopback
    Host names (and the one it binds)."""
    from orinfer.server.app import ServerLimits

    allowed_hosts = LOOPBACK_HOSTS | {args.host.lower()} if _is_loopback(args.host) and not args.api_key else None
    return ServerLimits(max_body_bytes=args.max_body_bytes, max_body_values=args.max_body_values,
                        max_header_bytes=args.max_header_bytes, max_n=args.max_n, max_tokens=args.max_tokens_limit,
                        max_pending_sequences=args.max_pending,
                        max_images_per_request=args.max_images_per_request, max_image_bytes=args.max_image_bytes,
                        max_image_pixels=args.max_image_pixels, max_request_image_pixels=args.max_request_image_pixels,
                        allowed_local_media_path=args.allowed_local_media_path, allowed_hosts=allowed_hosts,
                        request_read_timeout_s=args.request_read_timeout, max_connections=args.max_connections)


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from orinfer.server.app import build_app
    except ImportError as exc:
        print(f"error: `orinfer serve` needs FastAPI and uvicorn ({exc}); install them with "
              "pip install 'orinfer[serve]'", file=sys.stderr)
        return 2
    from orinfer.args import engine_args_from_namespace
    from orinfer.llm import LLM
    from orinfer.server import interpreter

    limits = serve_limits(args)
    if args.allowed_local_media_path is not None and not os.path.isdir(args.allowed_local_media_path):
        print(f"error: --allowed-local-media-path {args.allowed_local_media_path!r} is not a directory",
              file=sys.stderr)
        return 2
    if not _is_loopback(args.host) and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model",
                    args.host)
    engine_args = engine_args_from_namespace(args)
    if args.engine_process:
        from orinfer.server.engine_process import EngineProcess

        tokenizer = LLM.load_tokenizer(args.model, engine_args)
        llm = EngineProcess(functools.partial(LLM, args.model, engine_args), tokenizer)
    else:
        llm = LLM(args.model, engine_args)
    reasoning = {"auto": None, "qwen3": True, "none": False}[args.reasoning_parser]
    app = build_app(llm, args.served_model_name or args.model, api_key=args.api_key, limits=limits,
                    reasoning=reasoning, tool_call_parser=engine_args.tool_call_parser)
    # For the event loop's latency (interpreter.py says why): everything loaded so far, which lives as long as the
    # server, out of the collector's full passes; the interpreter lock back from busy worker threads sooner.
    interpreter.freeze_startup_heap()
    interpreter.shorten_switch_interval()
    uvicorn.Server(uvicorn_config(app, args.host, args.port, limits, args.uvicorn_log_level)).run()
    return 0


def uvicorn_config(app: Any, host: str, port: int, limits: Any, log_level: str = "info") -> Any:
    """uvicorn settings of the server: h11 (so that the header-size limit applies) with a deadline for reading each
    request (`http_protocol`), a cap on open connections, no Server header."""
    import uvicorn

    from orinfer.server.http_protocol import TimedH11Protocol

    protocol = type("ServerH11Protocol", (TimedH11Protocol,), {"read_timeout_s": limits.request_read_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, log_level=log_level, timeout_keep_alive=30,
                          timeout_graceful_shutdown=10, server_header=False, limit_concurrency=limits.max_connections,
                          h11_max_incomplete_event_size=limits.max_header_bytes)


class BackgroundServer:
    """Serves an app with uvicorn in a daemon thread (tests, notebooks). Port 0 picks a free port; `url` is the
    address it got. `stop()` (or leaving the `with` block) shuts the server and its engine loop down."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, limits: Any = None,
                 log_level: str = "warning") -> None:
        import uvicorn

        from orinfer.server.app import ServerLimits

        state = getattr(getattr(app, "state", None), "server", None)  # an app of build_app: its own limits
        limits = limits or getattr(state, "limits", None) or ServerLimits()
        self.server = uvicorn.Server(uvicorn_config(app, host, port, limits, log_level))
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="orinfer-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
