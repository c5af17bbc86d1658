"""The server's life: loading, serving, draining on SIGTERM, and what /health reports.

Starting: the engine process loads while the HTTP server already answers (/health 503
"loading"). Serving: requests are accepted. Draining (first SIGTERM or Ctrl+C): new requests
get 503, running ones may finish for up to the shutdown timeout, then they are aborted (a stream
ends with an error event and `[DONE]`), the engine is told to exit and the process ends. If the
engine dies, /health says so, its requests fail at once, and new ones get 503 with Retry-After
while a new engine starts (`ember.server.engine_supervisor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from ember.server.engine_client import EngineClient, EngineState
from ember.server.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05
# After the drain timeout, how long aborted requests may take to write their error.
ABORTED_WRITE_S = 2.0
# What a 503 asks a client to wait while the engine loads (or a new one starts).
LOADING_RETRY_AFTER_S = 5


class Lifecycle:
    """Admission control and health, shared by every handler of one app."""

    def __init__(self, client: EngineClient, shutdown_timeout_s: float) -> None:
        self.client = client
        self.shutdown_timeout_s = shutdown_timeout_s
        self.models_ready = False  # engine info attached to every served model
        self.draining = False
        self._num_handling = 0
        # Set by the process runner: ends the server with this exit code.
        self.request_exit: Callable[[int], None] = lambda code: None

    def health(self) -> tuple[bool, str]:
        """(healthy, reason) for GET /health."""
        if self.draining:
            return False, "the server is shutting down"
        if self.client.state != EngineState.READY:
            return False, self.client.unavailable_reason()
        if not self.models_ready:
            return False, "the model is still loading"
        return True, "ok"

    def check_accepting(self) -> None:
        """Raise 503 unless a new generation request may start now."""
        healthy, reason = self.health()
        if healthy:
            return
        if self.draining:
            raise ServiceUnavailableError(reason, code="shutting_down")
        if self.client.state == EngineState.LOADING or not self.models_ready:
            code = "loading"
        else:
            code = "engine_unavailable"  # lost: a new one is started (engine_supervisor)
        retry = {"Retry-After": str(LOADING_RETRY_AFTER_S)}
        raise ServiceUnavailableError(reason, code=code, headers=retry)

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Marks a handler that may still submit work, so a drain waits for it."""
        self._num_handling += 1
        try:
            yield
        finally:
            self._num_handling -= 1

    @property
    def idle(self) -> bool:
        return self._num_handling == 0 and self.client.num_in_flight == 0

    async def drain(self) -> None:
        """Refuse new requests and wait (up to the timeout) for running ones to finish."""
        self.draining = True
        deadline = time.monotonic() + self.shutdown_timeout_s
        if not self.idle:
            logger.info(
                "draining: waiting up to %.0f s for %d running requests",
                self.shutdown_timeout_s,
                self.client.num_in_flight,
            )
        while not self.idle and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if not self.idle:
            aborted = self.client.abort_all("the server is shutting down")
            logger.warning("drain timeout: aborted %d unfinished requests", aborted)
            # Their handlers now write the error (a stream: its error event and [DONE]); give
            # them a moment to, then the server closes what is left.
            deadline = time.monotonic() + ABORTED_WRITE_S
            while self._num_handling and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
