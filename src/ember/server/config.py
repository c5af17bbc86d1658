"""The server's settings, built once from the command line and never mutated."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.config import EngineConfig, MemoryConfig
from ember.server.reasoning.selection import REASONING_PARSER_NAMES
from ember.server.tool_calls.registry import PARSER_NAMES

DEFAULT_MAX_QUEUE = 1024
DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
QUEUE_FULL_RETRY_AFTER_S = 1
# How long a request may wait for its model to load or wake before a 503 with Retry-After.
DEFAULT_MODEL_LOAD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ServedModelSpec:
    """One model to serve: its engine settings (its policy among several models included), the
    front end's chat template override, and further names clients may use for it."""

    engine: EngineConfig
    chat_template: str | None = None
    aliases: tuple[str, ...] = ()
    # How the model writes tool calls (`ember.server.tool_calls.registry.PARSERS`); None: the
    # format its chat template shows, if any.
    tool_call_parser: str | None = None
    # How the model writes its reasoning (`ember.server.reasoning.selection`); None: gpt-oss's
    # harmony format where the tokenizer has its tokens, else no reasoning is read.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(
                f"unknown tool call parser {self.tool_call_parser!r}; choose from "
                + ", ".join(PARSER_NAMES)
            )
        if (
            self.reasoning_parser is not None
            and self.reasoning_parser not in REASONING_PARSER_NAMES
        ):
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}; choose from "
                + ", ".join(REASONING_PARSER_NAMES)
            )

    @property
    def name(self) -> str:
        # The CLI always settles the served name before building the spec.
        assert self.engine.served_model_name, "the served name is decided by the caller"
        return self.engine.served_model_name


@dataclass(frozen=True)
class RestartPolicy:
    """How the front end replaces a lost engine (`ember.server.engine_supervisor`): after
    ``backoff_s[k]`` seconds for the k-th loss in a row, and not more than ``max_losses`` times
    within ``window_s`` seconds (then the server exits non-zero)."""

    backoff_s: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
    window_s: float = 300.0
    max_losses: int = 5


@dataclass(frozen=True)
class CorsConfig:
    """Cross-origin requests (Starlette's CORSMiddleware), on only when configured; each list as
    vLLM's --allowed-* flags, ``("*",)`` meaning any."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True)
class ServerConfig:
    """Front-end settings; `models` lists what the engine process may load, `memory` the one
    budget they share."""

    models: tuple[ServedModelSpec, ...]
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    model_load_timeout_s: float = DEFAULT_MODEL_LOAD_TIMEOUT_S
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE  # waiting (not yet running) requests per model
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    show_progress: bool = True
    uvicorn_log_level: str = "info"
    access_log: bool = True
    engine_restart: RestartPolicy = field(default_factory=RestartPolicy)
    cors: CorsConfig | None = None  # None: no CORS headers, no preflight answers
    root_path: str = ""  # the prefix a proxy serves the app under (uvicorn's root_path)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    log_requests: bool = False  # one log line per API request, with its body cut short
    tokenizer_info_endpoint: bool = False  # GET /tokenizer_info, off unless asked (as vLLM)
