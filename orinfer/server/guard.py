"""The outermost layer of every HTTP request: `Guard`, a pure ASGI middleware that refuses oversized request heads
(431), Host headers the server does not answer to (403, DNS rebinding), checks the API key (401) and counts requests
by route and status for /metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from fastapi.responses import JSONResponse

from orinfer.server.errors import APIError
from orinfer.server.metrics import ServerMetrics

log = logging.getLogger(__name__)
_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json"}


class Guard:
    """Pure ASGI middleware: refuses oversized request heads (431; uvicorn's h11 limit only bounds a head that
    arrives in pieces), checks `Authorization: Bearer <key>` on every route but /health (in constant time), and counts
    HTTP requests by route and status."""

    def __init__(self, app: Any, api_key: str | None, metrics: ServerMetrics, max_header_bytes: int,
                 allowed_hosts: frozenset[str] | None = None) -> None:
        self.app, self.metrics = app, metrics
        self.key = api_key.encode() if api_key else None
        self.max_header_bytes = max_header_bytes
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}

    def _host_allowed(self, scope: dict[str, Any]) -> bool:
        if self.allowed_hosts is None:
            return True
        host = next((v for k, v in scope.get("headers", []) if k == b"host"), None)
        if host is None:
            return False
        name = host.decode("latin-1").strip().lower()
        if name.startswith("["):          # [v6 address]:port
            name = name[1:name.find("]")] if "]" in name else name
        else:
            name = name.rsplit(":", 1)[0] if name.count(":") == 1 else name
        return name in self.allowed_hosts

    def _head_size(self, scope: dict[str, Any]) -> int:
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        return size + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        status = [0]

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        cancelled = raised = False
        try:
            if self._head_size(scope) > self.max_header_bytes:
                err = APIError(431, f"the request headers are larger than {self.max_header_bytes} bytes",
                               code="request_header_fields_too_large")
                await JSONResponse(err.body(), status_code=431)(scope, receive, send_status)
                return
            if not self._host_allowed(scope):
                err = APIError(403, "this server answers only to the host names it serves (Host header refused)",
                               code="host_not_allowed")
                await JSONResponse(err.body(), status_code=403)(scope, receive, send_status)
                return
            if self.key is not None and path != "/health" and not self._authorized(scope):
                err = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                               code="invalid_api_key")
                response = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception:
            # Named here, with the route and whether a response had started: the 500 it becomes in /metrics (or the
            # broken stream) can then be traced to its request.
            raised = True
            log.exception("%s %s raised %s a response", scope.get("method", "?"), path,
                          "after starting" if status[0] else "before")
            raise
        finally:
            # A response that never started: cancelled (the client left, or the server is shutting down) is nginx's
            # 499, as the handlers answer a client that left; an app that returned without one got uvicorn's 500.
            code = status[0] or (499 if cancelled else 500)
            if code == 500 and not status[0] and not raised:
                log.error("%s %s returned no response: counted as 500", scope.get("method", "?"), path)
            self.metrics.http_requests.inc(route=path if path in _ROUTES else "other", code=str(code))
