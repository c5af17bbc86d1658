"""The server's settings, built once from the command line and never mutated."""

from __future__ import annotations

from dataclasses import dataclass

from ember.config import EngineConfig

DEFAULT_MAX_QUEUE = 1024
DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
QUEUE_FULL_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServedModelSpec:
    """One model to serve: its engine settings and the front end's chat template override."""

    engine: EngineConfig
    chat_template: str | None = None

    @property
    def name(self) -> str:
        # The CLI always settles the served name before building the spec.
        assert self.engine.served_model_name, "the served name is decided by the caller"
        return self.engine.served_model_name


@dataclass(frozen=True)
class ServerConfig:
    """Front-end settings; `models` lists what the engine process loads."""

    models: tuple[ServedModelSpec, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE  # waiting (not yet running) requests per model
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    show_progress: bool = True
    uvicorn_log_level: str = "info"
    access_log: bool = True
