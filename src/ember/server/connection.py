"""Noticing that the client went away, so its requests stop using the engine at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive

from ember.server.errors import ClientDisconnectedError

T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has closed the connection (the request body is already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(
    request: Request, work: Awaitable[T], on_disconnect: Callable[[], None]
) -> T:
    """Await `work` unless the client disconnects first: then cancel it, call `on_disconnect`
    and raise ClientDisconnectedError (for a non-streamed response, which has no generator to
    cancel)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            on_disconnect()
    if task not in done:
        raise ClientDisconnectedError()
    return task.result()
