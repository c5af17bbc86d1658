"""API key check: every route but /health and /metrics needs `Authorization: Bearer <key>`
when the server was started with --api-key (as the OpenAI clients send it)."""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from ember.server.errors import AuthenticationError

PUBLIC_PATHS = frozenset({"/health", "/metrics"})


class APIKeyMiddleware:
    """Pure ASGI middleware (no body buffering, streaming untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not secrets.compare_digest(given, self._expected):
            error = AuthenticationError(
                "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
