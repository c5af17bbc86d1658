"""The ASGI app factory: one FastAPI app per call, all its state on `app.state.ember`.

The tokenizers are loaded before (`load_served_model`), so a bad model path fails at once.
Startup (the app's lifespan) spawns the engine process and lets the HTTP server listen while
the engine is still loading the weights; /health turns 200 once it is ready. Shutdown tells the
engine to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

from ember.engine.gc_heap import freeze_startup_heap
from ember.server.auth import APIKeyMiddleware
from ember.server.body_limit import BodyLimitMiddleware
from ember.server.config import ServerConfig
from ember.server.engine_client import EngineClient
from ember.server.engine_supervisor import EngineSupervisor
from ember.server.errors import install_error_handlers
from ember.server.lifecycle import Lifecycle
from ember.server.metrics import ServerMetrics
from ember.server.models import ModelRegistry, ServedModel
from ember.server.progress import LoadProgressBar
from ember.server.request_log import RequestLogMiddleware
from ember.server.routes import build_router
from ember.server.sse import SERVER_SEND
from ember.server.state import ServerState

logger = logging.getLogger(__name__)


class EmberApp(FastAPI):
    """FastAPI that leaves the server's own `send` in each request's scope, under SERVER_SEND,
    before its middlewares wrap it: a stream's body chunks go there directly (`ember.server.sse`).
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def build_app(
    config: ServerConfig, models: list[ServedModel], failed: dict[str, str] | None = None
) -> EmberApp:
    """A new app serving `models` (the loaded `config.models`; ``failed``: the served names of
    those that could not be opened, with why); nothing starts until its lifespan runs."""
    progress = LoadProgressBar(config.show_progress)
    client = EngineClient(
        [spec.engine for spec in config.models],
        on_progress=progress.update,
        memory=config.memory,
        load_timeout_s=config.model_load_timeout_s,
    )
    state = ServerState(
        config=config,
        client=client,
        models=ModelRegistry(list(config.models)),
        metrics=ServerMetrics(
            [spec.name for spec in config.models],
            lambda: list(client.stats.values()),
            lambda: client.engine_gc,
            lambda: list(client.model_states.values()),
        ),
        lifecycle=Lifecycle(client, config.shutdown_timeout_s),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await client.start()
        supervisor = EngineSupervisor(
            client,
            on_first_ready=lambda: _on_engine_ready(state, progress),
            request_exit=lambda code: _exit(state, progress, code),
            stopping=lambda: state.lifecycle.draining,
            policy=config.engine_restart,
        )
        watcher = asyncio.create_task(supervisor.run(), name="engine-supervisor")
        try:
            yield
        finally:
            watcher.cancel()
            progress.close()
            await client.stop()

    app = EmberApp(
        title="ember",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    for model in models:
        state.models.add(model)
    for name, reason in (failed or {}).items():
        state.models.add_failed(name, reason)
    app.state.ember = state
    install_error_handlers(app)
    app.include_router(build_router())
    if config.log_requests:  # innermost: logs only bodies that passed the key and the limit
        app.add_middleware(RequestLogMiddleware)
    # Added last = runs first: the key is checked before a byte of the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.cors is not None:  # outermost: a preflight carries no key, a 401 needs the headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors.allowed_origins),
            allow_methods=list(config.cors.allowed_methods),
            allow_headers=list(config.cors.allowed_headers),
            allow_credentials=config.cors.allow_credentials,
        )
    return app


def _exit(state: ServerState, progress: LoadProgressBar, code: int) -> None:
    progress.close()
    state.lifecycle.request_exit(code)


def _on_engine_ready(state: ServerState, progress: LoadProgressBar) -> None:
    """The first engine has loaded: attach what it says of each model, and serve."""
    progress.close()
    for model in state.models.loaded():
        model.info = state.client.model_infos.get(model.name)
    # The front end's start-up heap (routes, tokenizers, templates) out of the collector's
    # oldest passes, which would stall every stream (ember.engine.gc_heap).
    freeze_startup_heap()
    state.lifecycle.models_ready = True
    for model in state.models.loaded():
        status = state.client.model_states.get(model.name)
        if status is None or status.state != "loaded":
            logger.info("ready: %s (%s: loads on its first request)", model.name, status)
            continue
        logger.info(
            "ready: %s (context %d tokens, %d KV blocks of %d, loaded in %.1f s)",
            model.name,
            model.info.max_model_len,
            status.num_kv_blocks,
            model.info.block_size,
            status.transitions.load_seconds,
        )
