"""Errors as the OpenAI API writes them: {"error": {"message", "type", "param", "code"}} with an HTTP status.

`APIError` is what handlers raise; `request_error` and `engine_error` translate the engine's exceptions; the handlers
installed by `add_error_handlers` turn everything else (unknown routes, wrong methods, bugs) into the same shape. Every
client mistake is a 4xx; a 5xx means a bug or a dead engine.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from orinfer.server.request_group import EngineDeadError

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is not available: {reason}", type="server_error", code="engine_unavailable")


def request_error(exc: Exception) -> APIError:
    """A RequestError (or another OrinferError) from the engine as a 400 naming the field where it can."""
    message = str(exc)
    match = re.match(r"invalid sampling parameter (\w+)=", message) or re.match(r"(structured_outputs)\.", message)
    code = "context_length_exceeded" if "context length" in message or "KV cache" in message else None
    return APIError(400, message, param=match.group(1) if match else None, code=code)


def engine_error(exc: Exception) -> APIError:
    """A failure of the engine while a request ran: 503 when the engine is gone, else 500."""
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    log.error("a request failed in the engine: %s", exc, exc_info=exc)   # the 500's cause, for the operator
    return APIError(500, str(exc) or "internal error", type="server_error", code="internal_error")


def add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind,
                       code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, f"invalid request: {exc.errors()[:1]}").body(), status_code=400)

    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client closed the connection before it finished sending its body: nobody reads an answer, and nothing
        # failed on our side (nginx's 499, as for a client that leaves before its completion is done).
        return Response(status_code=499)

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        err = APIError(500, "internal server error", type="server_error", code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, internal_error)
