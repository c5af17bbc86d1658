"""The front end's handle on the engine process: start it, send it requests and aborts, and route
its outputs to the HTTP handlers waiting for them.

One asyncio task reads the engine's output socket and puts each update in the inbox of the HTTP
request it belongs to; handlers never touch the socket. Sends are non-blocking (the socket's
queue is unbounded), so `submit` and `abort` are plain synchronous calls that are safe in a
`finally` block of a cancelled task. If the engine process dies, every waiting handler gets an
`EngineDeadError` at once and new requests are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import multiprocessing.process
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from ember.config import EngineConfig, MemoryConfig
from ember.engine.ipc import (
    AbortRequests,
    AddRequest,
    CommandDone,
    EngineFailed,
    EngineGc,
    EngineMessage,
    EngineReady,
    IpcAddresses,
    LoadProgress,
    ModelCommand,
    ModelInfo,
    ModelStates,
    ModelStats,
    ModelStatus,
    Shutdown,
    StepOutputs,
    configure_pull,
    configure_push,
)
from ember.engine.launch import start_engine_process
from ember.engine.step_types import RequestUpdate
from ember.sampling_params import SamplingParams
from ember.server.inbox import Inbox

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    DEAD = "dead"


class EngineDeadError(Exception):
    """The engine process failed or exited; the request cannot complete."""


class RequestRejectedError(Exception):
    """The engine refused the request: invalid for its model (``retry_after_s`` None), or its
    model could not be made ready in time (worth retrying after ``retry_after_s``)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# What a handler's inbox receives: (choice index, an update or one of the errors above).
QueueItem = tuple[int, RequestUpdate | EngineDeadError | RequestRejectedError]


@dataclass
class _Route:
    inbox: Inbox[QueueItem]
    index: int
    model: str
    waiting: bool = True  # no token yet: queued or prefilling in the engine


class EngineClient:
    """Owns the engine process and the two sockets to it."""

    def __init__(
        self,
        configs: list[EngineConfig],
        on_progress: Callable[[LoadProgress], None] | None = None,
        memory: MemoryConfig | None = None,
        load_timeout_s: float = 300.0,
    ) -> None:
        self.configs = configs
        self.memory = memory or MemoryConfig()
        self.load_timeout_s = load_timeout_s
        self.state = EngineState.LOADING
        self.failure: str | None = None
        self.model_infos: dict[str, ModelInfo] = {}
        self.model_states: dict[str, ModelStatus] = {}  # the engine's latest, per model
        self._commands: dict[str, asyncio.Future[CommandDone]] = {}
        self._command_ids = itertools.count()
        self.stats: dict[str, ModelStats] = {}
        self.engine_gc: EngineGc | None = None  # the engine process's collector passes
        self._on_progress = on_progress
        self._routes: dict[str, _Route] = {}
        self._num_waiting: dict[str, int] = {}
        self._loaded = asyncio.Event()  # set once ready or dead
        self._exited = asyncio.Event()
        self._died = asyncio.Event()  # set when the engine is lost (not when told to stop)
        self.restarts = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        # Created in start(), on the event loop that will read them.
        self._addresses: IpcAddresses | None = None
        self._sync_context: zmq.Context | None = None
        self._async_context: zmq.asyncio.Context | None = None
        self._requests: zmq.Socket | None = None
        self._outputs: zmq.asyncio.Socket | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the sockets and spawn the engine process; loading goes on in the background."""
        self._addresses = IpcAddresses.fresh()
        self._sync_context = zmq.Context(io_threads=1)
        self._async_context = zmq.asyncio.Context(io_threads=1)
        self._requests = self._sync_context.socket(zmq.PUSH)
        configure_push(self._requests)
        self._requests.bind(self._addresses.requests)
        self._outputs = self._async_context.socket(zmq.PULL)
        configure_pull(self._outputs)
        self._outputs.bind(self._addresses.outputs)
        self._process = start_engine_process(
            self.configs, self._addresses, self.memory, self.load_timeout_s
        )
        loop = asyncio.get_running_loop()
        loop.add_reader(self._process.sentinel, self._on_process_exit)
        self._reader = asyncio.create_task(self._read_outputs(), name="engine-output-reader")

    async def restart(self) -> None:
        """Start a new engine process after the last one was lost (`wait_dead`); its requests
        have failed already. The client is LOADING again until the new one is ready."""
        if self.state != EngineState.DEAD:
            raise RuntimeError(f"restart of an engine that is {self.state.value}")
        if self._process is not None and self._process.is_alive():
            self._process.kill()  # it broke its pipe or said it failed: it must not linger
            await asyncio.to_thread(self._process.join, 5)
        self._close_transport()
        self.state, self.failure = EngineState.LOADING, None
        self._loaded, self._exited, self._died = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.model_states, self.stats = {}, {}
        self.restarts += 1
        await self.start()

    async def wait_dead(self) -> None:
        """Wait until the engine is lost: its process died or it reported a failure."""
        await self._died.wait()

    async def wait_loaded(self) -> bool:
        """Wait until the engine has loaded every model (True) or failed (False)."""
        await self._loaded.wait()
        return self.state == EngineState.READY

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the engine to exit, wait for it (then kill it), and release the sockets."""
        was_loading = self.state == EngineState.LOADING
        if self.state in (EngineState.LOADING, EngineState.READY):
            self.state = EngineState.STOPPING
        self._fail_all("the server is shutting down")
        if self._process is not None and self._process.is_alive():
            if was_loading:
                self._process.terminate()  # it reads no message while loading; nothing to lose
            else:
                try:
                    self._requests.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    self._process.terminate()
            try:
                await asyncio.wait_for(self._exited.wait(), timeout_s)
            except TimeoutError:
                logger.warning("the engine did not exit in %.0f s; killing it", timeout_s)
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
        self._close_transport()

    def _close_transport(self) -> None:
        """Stop reading and release the sockets and their ipc paths."""
        if self._process is not None:
            with contextlib.suppress(ValueError, OSError):  # already removed, or closed
                asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._requests is not None:
            self._requests.close(linger=0)
            self._outputs.close(linger=0)
            self._sync_context.term()
            self._async_context.term()
            self._addresses.cleanup()
            self._requests = None

    # -- requests --------------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        model: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        inbox: Inbox[QueueItem],
        index: int,
    ) -> None:
        """Queue a sequence in the engine; its updates go to `inbox` tagged with `index`.
        All or nothing: if it raises, nothing of the sequence is left behind (a ValueError: its
        parameters cannot be sent)."""
        if self.state != EngineState.READY:
            raise EngineDeadError(self.unavailable_reason())
        try:
            payload = self._encoder.encode(AddRequest(request_id, model, prompt_token_ids, params))
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:
            raise ValueError(
                f"the request's parameters cannot be sent to the engine: {exc}"
            ) from exc
        self._routes[request_id] = _Route(inbox, index, model)
        self._num_waiting[model] = self._num_waiting.get(model, 0) + 1
        try:
            self._send_encoded(payload)
        except BaseException:
            self._forget(request_id)
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Stop these sequences now; their KV blocks are freed and later updates dropped."""
        live = [request_id for request_id in request_ids if self._forget(request_id)]
        if live and self._requests is not None and self.state != EngineState.DEAD:
            with contextlib.suppress(EngineDeadError):  # cleanup paths call this: never raise
                self._send(AbortRequests(live))

    async def command(self, model: str, action: str) -> CommandDone:
        """Load, sleep, wake or unload ``model`` in the engine; the answer once it is done."""
        if self.state != EngineState.READY:
            raise EngineDeadError(self.unavailable_reason())
        command_id = str(next(self._command_ids))
        answer: asyncio.Future[CommandDone] = asyncio.get_running_loop().create_future()
        self._commands[command_id] = answer
        try:
            self._send(ModelCommand(command_id, model, action))
            return await answer
        finally:
            self._commands.pop(command_id, None)

    def num_waiting(self, model: str) -> int:
        """Sequences of `model` submitted that have not produced a token yet."""
        return self._num_waiting.get(model, 0)

    @property
    def num_in_flight(self) -> int:
        return len(self._routes)

    def unavailable_reason(self) -> str:
        if self.state == EngineState.LOADING:
            return "the model is still loading"
        if self.state == EngineState.STOPPING:
            return "the server is shutting down"
        return f"the engine process is not running: {self.failure or 'unknown failure'}"

    def abort_all(self, reason: str) -> int:
        """End every sequence in flight: the engine stops them and their handlers get
        ``reason`` as an `EngineDeadError` (a stream's error event); returns how many."""
        live = list(self._routes)
        if live and self._requests is not None and self.state != EngineState.DEAD:
            with contextlib.suppress(EngineDeadError):
                self._send(AbortRequests(live))
        self._fail_routes(reason)
        return len(live)

    def _send(self, message: AddRequest | AbortRequests | ModelCommand) -> None:
        self._send_encoded(self._encoder.encode(message))

    def _send_encoded(self, payload: bytes) -> None:
        if self._requests is None:
            raise EngineDeadError("the engine connection is closed")
        try:
            self._requests.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._mark_dead(f"cannot reach the engine: {exc}")
            raise EngineDeadError(self.unavailable_reason()) from exc

    def _forget(self, request_id: str) -> bool:
        route = self._routes.pop(request_id, None)
        if route is None:
            return False
        if route.waiting:
            self._num_waiting[route.model] -= 1
        return True

    # -- outputs ---------------------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        while True:
            frame = await self._outputs.recv(copy=False)
            try:
                message = self._decoder.decode(frame.buffer)
            except msgspec.MsgspecError as exc:  # the two sides disagree: nothing is reliable
                logger.exception("reading engine outputs failed")
                self._mark_dead(f"bad message from the engine: {exc}")
                return
            try:
                self._dispatch(message)
            except Exception:  # a bug on this side: that message is lost, the engine is fine
                logger.exception("handling %s from the engine failed", type(message).__name__)

    def _dispatch(self, message: EngineMessage) -> None:
        if isinstance(message, StepOutputs):
            self._route_updates(message)
        elif isinstance(message, LoadProgress):
            if self._on_progress is not None:
                self._on_progress(message)
        elif isinstance(message, ModelStates):
            self.model_states = {status.model: status for status in message.models}
        elif isinstance(message, CommandDone):
            answer = self._commands.get(message.command_id)
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif isinstance(message, EngineReady):
            self.model_infos = {info.name: info for info in message.models}
            if self.state == EngineState.LOADING:
                self.state = EngineState.READY
            self._loaded.set()
        elif isinstance(message, EngineFailed):
            logger.error("engine failed: %s", message.message)
            self._mark_dead(message.message.splitlines()[0] if message.message else "failed")

    def _route_updates(self, message: StepOutputs) -> None:
        if message.stats is not None:
            for stats in message.stats:
                self.stats[stats.model] = stats
        if message.gc is not None:
            self.engine_gc = message.gc
        for rejected in message.rejected:
            route = self._routes.get(rejected.request_id)
            if route is not None:
                self._forget(rejected.request_id)
                error = RequestRejectedError(rejected.message, rejected.retry_after_s)
                route.inbox.put_nowait((route.index, error))
        for update in message.updates:
            route = self._routes.get(update.request_id)
            if route is None:
                continue  # aborted by the front end while the engine was stepping
            if route.waiting:
                route.waiting = False
                self._num_waiting[route.model] -= 1
            if update.finish_reason is not None:
                del self._routes[update.request_id]
            route.inbox.put_nowait((route.index, update))

    # -- failure ---------------------------------------------------------------------------------

    def _on_process_exit(self) -> None:
        assert self._process is not None
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        self._process.join(0)
        self._exited.set()
        if self.state != EngineState.STOPPING:
            self._mark_dead(f"the engine process exited with code {self._process.exitcode}")

    def _mark_dead(self, reason: str) -> None:
        if self.state == EngineState.DEAD:
            return
        if self.state != EngineState.STOPPING:
            logger.error("engine unavailable: %s", reason)
            self.failure = reason
            self.state = EngineState.DEAD
            self._died.set()
        self._loaded.set()
        self._fail_all(self.unavailable_reason())

    def _fail_all(self, reason: str) -> None:
        for answer in self._commands.values():
            if not answer.done():
                answer.set_exception(EngineDeadError(reason))
        self._fail_routes(reason)

    def _fail_routes(self, reason: str) -> None:
        routes, self._routes = self._routes, {}
        self._num_waiting.clear()
        for route in routes.values():
            route.inbox.put_nowait((route.index, EngineDeadError(reason)))
