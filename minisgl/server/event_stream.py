"""A server-sent event stream that gives up on a client that stops reading.

A client that keeps its connection open but reads nothing fills the socket's buffers, and then
every write to it waits: the request would hold its generations' text in memory for as long
as the client likes. After `write_timeout_s` of one write waiting, the stream ends (its
generations are aborted, if they still run) and the connection is closed."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Send

logger = logging.getLogger("uvicorn.error")  # the server's log, at its --log-level


class EventStream(StreamingResponse):
    def __init__(self, events: AsyncIterator[str], write_timeout_s: float) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.write_timeout_s = write_timeout_s
        self.check_s = min(1.0, write_timeout_s / 4)
        self.writing_since: float | None = None  # while a write waits for the client (time.monotonic())

    async def stream_response(self, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            self.writing_since = time.monotonic()
            await send(message)
            self.writing_since = None

        try:
            await super().stream_response(timed_send)
        finally:  # the events' own clean-up (aborting what still runs) now, not when collected
            await self.body_iterator.aclose()  # type: ignore[attr-defined]

    async def listen_for_disconnect(self, receive: Receive) -> None:
        """Returns when the client disconnects or stalls; Starlette then stops the stream."""
        disconnected = asyncio.ensure_future(super().listen_for_disconnect(receive))
        try:
            while not disconnected.done():
                await asyncio.wait({disconnected}, timeout=self.check_s)
                since = self.writing_since
                if since is not None and time.monotonic() - since > self.write_timeout_s:
                    logger.warning("a stream's client read nothing for %g s: its stream ends", self.write_timeout_s)
                    return
        finally:
            disconnected.cancel()
