"""Server-sent events as the OpenAI API streams them: `data: <json>\\n\\n` per chunk, an error
as one more event, and `data: [DONE]\\n\\n` at the end.

`EventStreamResponse` sends the events while it watches the connection: when the client goes
away it cancels the stream at once (so the generator's cleanup aborts the engine requests)
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


def sse_event(payload: dict) -> bytes:
    """One event carrying `payload` as JSON."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def openai_event_stream(
    events: AsyncIterator[bytes], cleanup: Callable[[], None]
) -> AsyncIterator[bytes]:
    """`events`, then `data: [DONE]`. An error while producing them becomes one error event
    before [DONE]; `cleanup` runs however the stream ends (a disconnect cancels it)."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        yield sse_event(exc.body())
    except Exception as exc:
        logger.exception("error while streaming")
        yield sse_event(InternalServerError(f"{type(exc).__name__}: {exc}").body())
    finally:
        cleanup()
    yield DONE_EVENT


class EventStreamResponse(Response):
    """Streams `events` (already framed) and stops them when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self._send_events(send))
        watcher = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Whichever is left is cancelled: a disconnect cancels the stream (its cleanup aborts
            # the engine requests); the end of the stream retires the watcher.
            for task in (stream, watcher):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            try:
                await stream
            except asyncio.CancelledError:
                pass
            finally:
                await self.events.aclose()

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
