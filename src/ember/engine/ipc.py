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


FrontendMessage = AddRequest | AbortRequests | Shutdown

# ------------------------------------------------------------------------ engine -> front end


class LoadProgress(msgspec.Struct, tag="progress", array_like=True):
    """`done` of `total` weight tensors of `model` are loaded (`total` None when unknown)."""

    model: str
    done: int
    total: int | None


class ModelInfo(msgspec.Struct, array_like=True):
    """What the front end needs to know about one loaded model."""

    name: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    load_seconds: float


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    models: list[ModelInfo]


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    """The engine could not load or crashed; it exits right after sending this."""

    message: str


class RequestRejected(msgspec.Struct, array_like=True):
    """The engine refused a request (its ValueError); nothing was queued."""

    request_id: str
    message: str


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


EngineMessage = LoadProgress | EngineReady | EngineFailed | StepOutputs

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

    def receive(self, block: bool) -> list[FrontendMessage]:
        """Every message waiting now; with `block`, first wait (without a timeout) for one.

        Returns an empty list once the parent has died (and sets `parent_alive` false); a busy
        engine notices too, since each call polls the parent's pipe (one cheap syscall).
        """
        events = dict(self._poller.poll(None if block else 0))
        if self._parent_death_fd is not None and self._parent_death_fd in events:
            self.parent_alive = False
            return []
        messages = []
        while True:
            try:
                frame = self._inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            messages.append(self._decoder.decode(frame.buffer))

    def send(self, message: EngineMessage) -> None:
        self._outbox.send(self._encoder.encode(message), copy=False)

    def close(self) -> None:
        self._inbox.close()
        self._outbox.close()
        self._context.term()
