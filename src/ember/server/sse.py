"""Server-sent events as the OpenAI API streams them: `data: <json>\\n\\n` per chunk, an error
as one more event, and `data: [DONE]\\n\\n` at the end.

`EventStreamResponse` sends the events while it watches the connection: when the client goes
away it cancels the stream at once (so the stream's cleanup aborts the engine requests)
rather than generating into a closed socket until the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ember.server.connection import wait_for_disconnect
from ember.server.errors import APIError, InternalServerError

logger = logging.getLogger(__name__)

DONE_EVENT = b"data: [DONE]\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Where the app puts the server's own `send` in a request's scope (`ember.server.app`).
SERVER_SEND = "ember.server_send"


def sse_event(payload: dict) -> bytes:
    """One event carrying `payload` as JSON."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class ChunkEncoder:
    """Events of one stream's chunks, `{**header, "choices": [choice]}` each: the header (the
    same in every chunk) is encoded once, and each chunk encodes only its choice."""

    def __init__(self, header: dict) -> None:
        assert header, "the splice below needs at least one field before choices"
        self._prefix = b"data: " + msgspec.json.encode(header)[:-1] + b',"choices":['
        self._encode = msgspec.json.Encoder().encode

    def event(self, choice: dict) -> bytes:
        return b"".join((self._prefix, self._encode(choice), b"]}\n\n"))


class EventStreamResponse(Response):
    """Streams `events` (already framed), then `data: [DONE]`, and stops them when the client
    disconnects. An error while producing them becomes one error event before [DONE];
    `cleanup` runs however the stream ends (a disconnect cancels it)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], cleanup: Callable[[], None]) -> None:
        self.events = events
        self.cleanup = cleanup
        self.status_code = 200
        self.background = None
        self.init_headers(_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The body goes straight to the server: the middlewares' send wrappers only watch for
        # the response start (which still passes them), yet cost a call each per event.
        send_body = scope.get(SERVER_SEND, send)
        stream = asyncio.create_task(self._send_events(send, send_body))
        watcher = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Whichever is left is cancelled: a disconnect cancels the stream (and the cleanup
            # aborts its engine requests); the end of the stream retires the watcher. The
            # cleanup runs here, not in the stream: a task cancelled before it ran runs nothing.
            for task in (stream, watcher):
                task.cancel()
            self.cleanup()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            try:
                await stream
            except asyncio.CancelledError:
                pass
            finally:
                await self.events.aclose()

    async def _send_events(self, send: Send, send_body: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        last = DONE_EVENT
        try:  # a send never raises (after a disconnect it returns): errors are the events'
            async for event in self.events:
                await send_body({"type": "http.response.body", "body": event, "more_body": True})
        except APIError as exc:
            last = sse_event(exc.body()) + DONE_EVENT
        except Exception as exc:
            logger.exception("error while streaming")
            error = InternalServerError(f"{type(exc).__name__}: {exc}")
            last = sse_event(error.body()) + DONE_EVENT
        # [DONE] and the end of the body in one write.
        await send_body({"type": "http.response.body", "body": last, "more_body": False})
