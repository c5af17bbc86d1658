"""Everything one app instance needs at request time, kept on `app.state.ember`."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from ember.server.config import ServerConfig
from ember.server.engine_client import EngineClient
from ember.server.lifecycle import Lifecycle
from ember.server.metrics import ServerMetrics
from ember.server.models import ModelRegistry


@dataclass
class ServerState:
    config: ServerConfig
    client: EngineClient
    models: ModelRegistry
    metrics: ServerMetrics
    lifecycle: Lifecycle


def server_state(request: Request) -> ServerState:
    return request.app.state.ember
