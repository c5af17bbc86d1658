"""Typed messages between the front-end process and the engine process, and the sockets that
carry them.

Both directions carry token ids, never text. Every message is a msgspec Struct encoded as
msgpack; a tagged union per direction lets one decoder read any message of that direction. The
front end binds two ZMQ PUSH/PULL pipes (requests in, outputs out) on ipc:// paths and the
engine connects to them. Send buffers are unbounded (HWM 0) so that neither side ever blocks on
a slow peer: the engine never waits on HTTP, the front end never waits on a step.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import msgspec
import zmq

from ember.engine.step_types import RequestUpdate
from ember.sampling_params import SamplingParams

# ------------------------------------------------------------------------ front end -> engine


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """Queue one sequence on the model served as `model`."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """End these requests now and free their KV blocks (unknown ids are ignored)."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Abort everything and exit."""


MODEL_ACTIONS = ("load", "sleep", "wake", "unload")


class ModelCommand(msgspec.Struct, tag="command", array_like=True):
    """Load, sleep, wake or unload the configured model `model`; answered by `CommandDone`."""

    command_id: str
    model: str
    action: str


FrontendMessage = AddRequest | AbortRequests | ModelCommand | Shutdown


@dataclass(frozen=True)
class UnreadableRequest:
    """Made by the engine's channel, never sent: an `AddRequest` whose fields did not decode
    (say, sampling parameters that fail their checks), to be refused by its id rather than
    taking the engine loop down."""

    request_id: str
    message: str


# ------------------------------------------------------------------------ engine -> front end


class LoadProgress(msgspec.Struct, tag="progress", array_like=True):
    """`done` of `total` weight tensors of `model` are loaded (`total` None when unknown)."""

    model: str
    done: int
    total: int | None


class ModelInfo(msgspec.Struct, array_like=True):
    """What the front end needs to know about one configured model (known before it loads)."""

    name: str
    max_model_len: int
    vocab_size: int
    block_size: int


class TransitionCounts(msgspec.Struct, array_like=True):
    """A model's completed transitions and the seconds they took, cumulative since start;
    ``last_*``: the latest one."""

    loads: int = 0
    sleeps: int = 0
    wakes: int = 0
    load_seconds: float = 0.0
    sleep_seconds: float = 0.0
    wake_seconds: float = 0.0
    last_action: str | None = None
    last_seconds: float | None = None


class ModelStatus(msgspec.Struct, array_like=True):
    """One configured model's state and memory, sent whenever either changes."""

    model: str
    state: str  # unloaded, loading, loaded, sleeping, waking, failed
    pinned: bool = False
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    num_kv_blocks: int = 0
    device_bytes: int = 0  # what the engine's budget charges it now
    host_bytes: int = 0  # pinned host memory holding its weights while it sleeps
    transitions: TransitionCounts = msgspec.field(default_factory=TransitionCounts)
    error: str | None = None


class ModelStates(msgspec.Struct, tag="states", array_like=True):
    models: list[ModelStatus]


class CommandDone(msgspec.Struct, tag="done", array_like=True):
    """The answer to a `ModelCommand`: ``status`` is HTTP-shaped (200, 409 wrong state, 503
    cannot fit or failed), ``seconds`` the time the action took."""

    command_id: str
    status: int
    message: str
    state: str
    seconds: float


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    """The models configured to load at start have loaded (or failed); `models` lists every
    configured model."""

    models: list[ModelInfo]


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    """The engine could not load or crashed; it exits right after sending this."""

    message: str


class RequestRejected(msgspec.Struct, array_like=True):
    """The engine refused a request: invalid for its model (``retry_after_s`` None), or its
    model could not be made ready in time (a number: worth retrying after that long)."""

    request_id: str
    message: str
    retry_after_s: float | None = None


class ModelStats(msgspec.Struct, array_like=True):
    """A snapshot of one model's scheduler and KV pool, for /metrics."""

    model: str
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int  # cumulative since start
    # The scheduler's `StepCounts`, cumulative since start.
    decode_only_steps: int = 0
    prefill_steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    # The KV cache manager's `PrefixCacheStats`, cumulative since start, in tokens.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineGc(msgspec.Struct, array_like=True):
    """The engine process's garbage-collector passes since its loop started, per generation
    (0, 1, 2), for /metrics: a generation-2 pass stops every model's steps while it runs."""

    passes: list[int]
    pause_seconds: list[float]


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """Everything one engine iteration produced: token updates of all models, rejections, and
    (at most every ~0.5 s, and whenever the engine goes idle) fresh stats and collector passes."""

    updates: list[RequestUpdate]
    rejected: list[RequestRejected] = []
    stats: list[ModelStats] | None = None
    gc: EngineGc | None = None


EngineMessage = LoadProgress | EngineReady | EngineFailed | StepOutputs | ModelStates | CommandDone

# ------------------------------------------------------------------------ sockets


@dataclass(frozen=True)
class IpcAddresses:
    """The two ZMQ endpoints: requests flow to the engine on `requests`, outputs on `outputs`."""

    requests: str
    outputs: str

    @classmethod
    def fresh(cls) -> IpcAddresses:
        """Unique ipc:// paths in a new private temporary directory."""
        directory = tempfile.mkdtemp(prefix="ember-ipc-")
        return cls(
            requests=f"ipc://{os.path.join(directory, 'requests')}",
            outputs=f"ipc://{os.path.join(directory, 'outputs')}",
        )

    def cleanup(self) -> None:
        """Remove the socket files and their directory (front end, at exit)."""
        directory = None
        for address in (self.requests, self.outputs):
            path = address.removeprefix("ipc://")
            directory = os.path.dirname(path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if directory:
            try:
                os.rmdir(directory)
            except OSError:
                pass


def configure_push(sock: zmq.Socket) -> None:
    # Unbounded queue: a send never blocks on a slow reader; a short linger delivers the last
    # message (a shutdown, a failure report) before close.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 2000)


def configure_pull(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)


class EngineChannel:
    """The engine's end: a blocking-when-idle reader of front-end messages and a writer of
    engine messages. It also watches an optional file descriptor that becomes readable when the
    parent process dies, so an idle engine notices without polling on a timer."""

    def __init__(self, addresses: IpcAddresses, parent_death_fd: int | None = None) -> None:
        self._context = zmq.Context(io_threads=1)
        self._inbox = self._context.socket(zmq.PULL)
        configure_pull(self._inbox)
        self._inbox.connect(addresses.requests)
        self._outbox = self._context.socket(zmq.PUSH)
        configure_push(self._outbox)
        self._outbox.connect(addresses.outputs)
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        self._parent_death_fd = parent_death_fd
        if parent_death_fd is not None:
            self._poller.register(parent_death_fd, zmq.POLLIN)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FrontendMessage)
        self.parent_alive = True

    def receive(
        self, block: bool, timeout_s: float | None = None
    ) -> list[FrontendMessage | UnreadableRequest]:
        """Every message waiting now; with `block`, first wait for one (at most ``timeout_s``,
        None: no limit).

        Returns an empty list once the parent has died (and sets `parent_alive` false); a busy
        engine notices too, since each call polls the parent's pipe (one cheap syscall).
        """
        wait_ms = (None if timeout_s is None else max(0, int(timeout_s * 1000))) if block else 0
        events = dict(self._poller.poll(wait_ms))
        if self._parent_death_fd is not None and self._parent_death_fd in events:
            self.parent_alive = False
            return []
        messages = []
        while True:
            try:
                frame = self._inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            messages.append(self._decode(frame.buffer))

    def _decode(self, buffer) -> FrontendMessage | UnreadableRequest:
        try:
            return self._decoder.decode(buffer)
        except msgspec.MsgspecError as exc:
            raw = msgspec.msgpack.decode(buffer)  # the front end sent it: it is msgpack
            if (
                isinstance(raw, list)
                and len(raw) > 1
                and raw[0] == "add"
                and isinstance(raw[1], str)
            ):
                return UnreadableRequest(raw[1], f"invalid request: {exc}")
            raise

    def send(self, message: EngineMessage) -> None:
        self._outbox.send(self._encoder.encode(message), copy=False)

    def close(self) -> None:
        self._inbox.close()
        self._outbox.close()
        self._context.term()
