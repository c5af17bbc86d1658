"""Run the front-end process: uvicorn on uvloop + httptools serving the app, with a graceful
drain on SIGTERM / Ctrl+C (a second signal exits at once)."""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from ember.dependencies import MissingDependencyError, require_triton
from ember.server.app import build_app
from ember.server.config import ServerConfig
from ember.server.lifecycle import Lifecycle
from ember.server.models import load_served_model

logger = logging.getLogger(__name__)

# After the drain, connections still open (idle keep-alives, a last chunk in flight) get this
# long before uvicorn cancels them.
CLOSE_CONNECTIONS_TIMEOUT_S = 3.0


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first exit signal drains instead of closing the listener.

    Uvicorn stops accepting connections as soon as it is told to exit; we want new requests
    to get a 503 while running ones finish, so exiting is deferred until the drain is over.
    """

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        lifecycle.request_exit = self.request_exit

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in a signal handler: only schedule work on the loop from here.
        if self._drain_task is not None or self._loop is None:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        logger.info("%s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.lifecycle.drain()
        self.should_exit = True

    def request_exit(self, code: int) -> None:
        """Stop serving (used when loading fails)."""
        self.exit_code = code
        self.should_exit = True


def uvicorn_config(config: ServerConfig, app) -> uvicorn.Config:
    """How uvicorn serves ``app``: where, with TLS when given a key and certificate, under the
    proxy's root path."""
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        log_level=config.uvicorn_log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=CLOSE_CONNECTIONS_TIMEOUT_S,
        timeout_keep_alive=5,
        root_path=config.root_path,
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
    )


def run_server(config: ServerConfig) -> int:
    """Serve until drained; the process exit code."""
    try:
        for spec in config.models:
            if spec.engine.asks_for_triton:
                require_triton()  # here, before an engine process is started for nothing
    except MissingDependencyError as exc:
        logger.error("cannot serve: %s", exc)
        return 1
    models, failed = [], {}
    for spec in config.models:
        try:
            models.append(load_served_model(spec))
        except (OSError, ValueError) as exc:
            # no such model, unreadable file, bad template: with several models, the others
            # are still served and this one answers with the error
            logger.error("cannot serve %s: %s", spec.name, exc)
            failed[spec.name] = str(exc)
    if not models:
        return 1
    app = build_app(config, models, failed)
    server = DrainingServer(uvicorn_config(config, app), app.state.ember.lifecycle)
    server.run()
    if not server.started and server.exit_code == 0:
        return 1  # startup failed (bad model, port in use): uvicorn logged why
    return server.exit_code
