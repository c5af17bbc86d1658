"""Keep an engine process running behind the front end, for as long as the server runs.

The first load decides whether the server starts: if it fails, the server exits non-zero (a
bad model or setting stays bad). Once it has served, a lost engine (its process died, or it
reported a failure) is replaced: the requests it had fail at once (a stream gets an error event
and `[DONE]`), new ones get 503 with Retry-After while a new engine loads, after a backoff that
grows with each loss. Losses in quick succession mean something is wrong that a restart will
not fix: past `RestartPolicy.max_losses` within its window, the server exits non-zero so that
its own supervisor (systemd, Kubernetes) sees it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from ember.server.config import RestartPolicy
from ember.server.engine_client import EngineClient

logger = logging.getLogger(__name__)


class EngineSupervisor:
    """Watches one `EngineClient`; `run` is the app's background task."""

    def __init__(
        self,
        client: EngineClient,
        on_first_ready: Callable[[], None],
        request_exit: Callable[[int], None],
        stopping: Callable[[], bool],
        policy: RestartPolicy,
    ) -> None:
        self.client = client
        self._on_first_ready = on_first_ready
        self._request_exit = request_exit
        self._stopping = stopping
        self._policy = policy
        self._losses: collections.deque[float] = collections.deque()

    async def run(self) -> None:
        client = self.client
        if not await client.wait_loaded():
            logger.error("the engine failed to load: %s", client.failure)
            self._request_exit(1)
            return
        self._on_first_ready()
        while True:
            await client.wait_dead()
            if self._stopping():
                return
            delay = self._record_loss()
            if delay is None:
                logger.error(
                    "the engine was lost %d times within %.0f s (last: %s); exiting",
                    len(self._losses),
                    self._policy.window_s,
                    client.failure,
                )
                self._request_exit(1)
                return
            logger.error(
                "the engine was lost (%s); starting a new one in %.0f s", client.failure, delay
            )
            await asyncio.sleep(delay)
            if self._stopping():
                return
            await client.restart()
            if await client.wait_loaded():
                logger.info("a new engine is serving (restart %d)", client.restarts)

    def _record_loss(self) -> float | None:
        """Count a loss; the delay before the next start, or None when there were too many."""
        now = time.monotonic()
        self._losses.append(now)
        while self._losses and now - self._losses[0] > self._policy.window_s:
            self._losses.popleft()
        if len(self._losses) > self._policy.max_losses:
            return None
        backoff = self._policy.backoff_s
        return backoff[min(len(self._losses), len(backoff)) - 1]
