"""uvicorn's HTTP/1.1 protocol with two bounds a server facing the open network needs.

uvicorn times out only idle keep-alive connections: a client that opens a connection and sends
its request a byte at a time, or never finishes it, holds the connection (and an open file) for
ever, and enough of them leave the server unable to accept anyone (slowloris). Here:
- each request must arrive whole (headers and body) within `request_timeout_s` of its first
  byte's connection or of the previous response; otherwise the connection is closed;
- at most `max_connections` are open at once: a connection beyond them is closed as it is made,
  so its file is given back at once and the ones being served keep theirs.
Time spent answering (a long stream) is not bounded here: the request is whole by then.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class BoundedH11Protocol(H11Protocol):
    request_timeout_s = 30.0  # serve --request-timeout
    max_connections = 1024  # serve --max-connections

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            transport.close()  # before it is counted or read: nothing of it is kept
            return
        super().connection_made(transport)
        self.request_deadline: asyncio.TimerHandle | None = None
        self._await_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.SEND_BODY and self.conn.their_state is not h11.IDLE:
            self._request_arrived()  # whole (DONE), or the connection is ending

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_request()  # the next request on this keep-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.connections:  # not a connection refused in connection_made
            self._request_arrived()
            super().connection_lost(exc)

    def _await_request(self) -> None:
        self._request_arrived()
        self.request_deadline = self.loop.call_later(self.request_timeout_s, self._request_too_slow)

    def _request_arrived(self) -> None:
        if self.request_deadline is not None:
            self.request_deadline.cancel()
            self.request_deadline = None

    def _request_too_slow(self) -> None:
        self.request_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def bounded_protocol(request_timeout_s: float, max_connections: int) -> type[BoundedH11Protocol]:
    """The protocol class uvicorn builds each connection from, with this server's bounds."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,),
                {"request_timeout_s": request_timeout_s, "max_connections": max_connections})
