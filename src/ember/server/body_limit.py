"""Refuse request bodies over a size limit with 413, before any of them is parsed.

The body is read here (up to the limit) and replayed to the app; later `receive` calls go to
the server, so the app can still notice a disconnect.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.server.errors import PayloadTooLargeError


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks = None  # the client left while sending
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks) if chunks is not None else None
        await self.app(scope, _replay(body, receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = PayloadTooLargeError(
            f"the request body exceeds the limit of {self.max_bytes} bytes"
        )
        await error.response()(scope, receive, send)


def _replay(body: bytes | None, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then defers to the server."""
    pending = [body]

    async def replayed() -> Message:
        if pending and pending[0] is not None:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        pending.clear()
        return await receive()

    return replayed
