"""uvicorn's h11 protocol with a deadline for reading each request (slow clients).

uvicorn closes a keep-alive connection that stays idle, but not one that opens and sends nothing, sends half a head,
or trickles its body: each such connection is held forever, and a client that opens a thousand of them leaves no
room for anybody else. Here every request must arrive whole (head and body) within `REQUEST_READ_TIMEOUT_S` of the
connection opening or of its first byte; otherwise the connection is closed. Responses, streamed ones included, are
not limited: the deadline ends once h11 has the whole request.
"""

from __future__ import annotations

from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_READ_TIMEOUT_S = 30.0


class TimedH11Protocol(H11Protocol):
    """`H11Protocol` that closes a connection whose current request has not been received whole in time."""

    read_timeout_s = REQUEST_READ_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None and self.conn.their_state is h11.IDLE:
            # The first byte of a next request on a kept-alive connection: its own deadline starts.
            self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
        super().data_received(data)
        self._stop_deadline_if_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None
        super().connection_lost(exc)

    def _stop_deadline_if_received(self) -> None:
        if self._read_deadline is not None and self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED) and not self.transport.is_closing():
            self.transport.close()
