"""The server's life: loading, serving, draining on SIGTERM, and what /health reports.

Starting: the engine process loads while the HTTP server already answers (/health 503
"loading"). Serving: requests are accepted. Draining (first SIGTERM or Ctrl+C): new requests
get 503, running ones may finish for up to the shutdown timeout, then the engine is told to exit
and the process ends. If the engine dies, /health says so and requests fail at once with 503.
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
            code = "shutting_down"
        elif self.client.state == EngineState.LOADING or not self.models_ready:
            code = "loading"
        else:
            code = "engine_unavailable"
        raise ServiceUnavailableError(reason, code=code)

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
            logger.warning(
                "drain timeout: aborting %d unfinished requests", self.client.num_in_flight
            )
