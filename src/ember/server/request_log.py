"""`--enable-log-requests`: one log line per API request with its body (cut short and escaped,
`ember.server.log_text`), logged as the app reads it. Off by default, as in vLLM: bodies hold
users' prompts."""

from __future__ import annotations

import itertools
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.server.log_text import log_text

logger = logging.getLogger(__name__)

MAX_LOGGED_BODY_CHARS = 1000


class RequestLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._numbers = itertools.count(1)  # per app: tells the lines of one request apart

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        number, chunks, logged_once = next(self._numbers), [], False
        client = scope.get("client")
        origin = f"{client[0]}:{client[1]}" if client else "?"

        async def logged() -> Message:
            nonlocal logged_once
            message = await receive()
            if message["type"] == "http.request" and not logged_once:
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    logged_once = True
                    body = b"".join(chunks).decode("utf-8", errors="replace")
                    logger.info(
                        "request %d: %s %s from %s: %s",
                        number,
                        scope["method"],
                        scope["path"],
                        origin,
                        log_text(body, MAX_LOGGED_BODY_CHARS),
                    )
            return message

        await self.app(scope, logged, send)
