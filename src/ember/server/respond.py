"""Answer a generation either as a server-sent event stream or, once it is done, as one JSON body.

Both endpoints end the same way; only how they format a stream chunk or the whole response differs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from ember.server.connection import cancel_on_disconnect
from ember.server.generation import Generation
from ember.server.responses import JSONResponse
from ember.server.sse import EventStreamResponse


async def respond(
    request: Request,
    generation: Generation,
    stream: AsyncIterator[bytes] | None,
    whole: Callable[[], dict],
) -> Response:
    """Stream `stream` if given; else run the generation to the end (aborting it if the client
    leaves) and send `whole()`."""
    if stream is not None:
        return EventStreamResponse(stream, generation.abort)
    try:
        await cancel_on_disconnect(request, _run(generation), generation.abort)
    finally:
        generation.abort()
    return JSONResponse(whole())


async def _run(generation: Generation) -> None:
    async for _ in generation.deltas():
        pass
