"""Rank 0's handle on the other ranks of a tensor-parallel model: their processes, started and
watched by the process that holds the model (the engine process, or the offline `LLM`'s).

Each rank past the first is a spawned process (`ember.parallel.worker`) with a pipe to rank 0.
They meet through a `torch.distributed` store that rank 0 serves on a port the system picks, so
two models (or two engines) never ask for the same one. Over the pipe a worker says when it
has planned its model (then every rank joins the process group), when its weights have loaded
(``ready``, with the bytes it read), or why it failed; rank 0 sends one pickled `ShardStep` per
step and, to stop, None.

Why a pipe and not a broadcast over the group: a step's message is of a size the workers cannot
know ahead (a broadcast needs it: a second collective, or a buffer of the largest step every
step), it is host data that a GPU group would have to stage through device memory, and a pipe's
end and the process's sentinel tell rank 0 at once that a worker is gone. Rank 0 checks the
sentinels before each step and after a step that raised, so a worker that dies fails the model
with an error naming the rank and its exit code (and the worker's own error, where it could
send one) instead of leaving rank 0 waiting in a collective: gloo fails a collective whose peer
is gone at once; on GPUs a thread watching the sentinels aborts the NCCL group, whose kernels
would otherwise wait for the peer until the group's timeout.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ember.config import EngineConfig
from ember.parallel.group import COLLECTIVE_TIMEOUT_S, TorchParallelGroup
from ember.parallel.shard_step import ShardStep

logger = logging.getLogger(__name__)

# How long the workers may take to plan their model (import torch, read config and headers),
# and then to load their weights, before rank 0 gives up on them.
JOIN_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 3600.0
# How long a worker told to stop may take to exit before it is terminated.
STOP_TIMEOUT_S = 10.0
EXIT_GRACE_S = 2.0
_HOST = "127.0.0.1"


class StepPeers(Protocol):
    """Where a runner sends each step's inputs for the other ranks."""

    def send(self, step: ShardStep) -> None: ...


class WorkerLostError(RuntimeError):
    """A tensor-parallel worker exited or failed; the model cannot step."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with: the model's config (its ``device`` this rank's), its rank
    of ``size``, the store's port, and the KV cache's block count (rank 0's decision)."""

    config: EngineConfig
    rank: int
    size: int
    store_port: int
    num_blocks: int


@dataclass
class _Worker:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    error: str | None = None  # what it said when it failed


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the GPU ``rank`` past rank 0's; the CPU for every rank on one."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class ShardWorkers:
    """Ranks 1..size-1 of one model, and rank 0's process group with them (``group``).
    `start` returns once every rank has joined the group; `wait_ready` once their weights
    have loaded."""

    def __init__(self, store: dist.TCPStore, workers: list[_Worker]) -> None:
        self._store = store
        self._workers = workers
        self.group: TorchParallelGroup | None = None
        self.bytes_read: dict[int, int] = {}  # by rank, once ready
        self._closing = False

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device, num_blocks: int) -> ShardWorkers:
        """Spawn the workers of ``config``'s model (rank 0 on ``device``) and join their
        process group; raises (with every worker stopped) if one fails or dies first."""
        from ember.parallel.worker import worker_main

        size = config.tensor_parallel_size
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.TCPStore(
            _HOST, 0, size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        context = multiprocessing.get_context("spawn")
        workers: list[_Worker] = []
        handle = cls(store, workers)
        try:
            for rank in range(1, size):
                ours, theirs = context.Pipe()
                spec = WorkerSpec(
                    config=_on_device(config, rank_device(device, rank)),
                    rank=rank,
                    size=size,
                    store_port=store.port,
                    num_blocks=num_blocks,
                )
                process = context.Process(
                    target=worker_main,
                    args=(spec, theirs),
                    name=f"ember-tp-rank{rank}",
                    daemon=True,  # never outlives the process holding the model
                )
                process.start()
                theirs.close()
                workers.append(_Worker(rank, process, ours))
            handle._wait_for("joining", JOIN_TIMEOUT_S)
            handle.group = TorchParallelGroup(store, 0, size, device)
            if device.type == "cuda":
                threading.Thread(target=handle._watch, name="tp-watch", daemon=True).start()
        except BaseException:
            handle.close()
            raise
        return handle

    @property
    def pids(self) -> dict[int, int]:
        """Each worker's process id, by rank."""
        return {worker.rank: worker.process.pid for worker in self._workers}

    def wait_ready(self) -> None:
        """Block until every worker has loaded its weights (raises if one fails or dies)."""
        for rank, payload in self._wait_for("ready", READY_TIMEOUT_S).items():
            self.bytes_read[rank] = payload

    def send(self, step: ShardStep | None) -> None:
        """Send every worker one step (None: stop); WorkerLostError if one is gone."""
        self.check_alive()
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self._workers:
            try:
                worker.conn.send_bytes(data)
            except OSError as exc:
                self.check_alive()
                raise WorkerLostError(
                    f"tensor-parallel rank {worker.rank} does not take steps: {exc}"
                ) from exc

    def check_alive(self, cause: BaseException | None = None) -> None:
        """WorkerLostError naming the first worker that has exited, and how (raised from
        ``cause``: what the step that met its absence raised)."""
        sentinels = {worker.process.sentinel: worker for worker in self._workers}
        # A peer's socket may close a moment before its process is reaped: after a failed
        # step, give its sentinel that moment.
        grace = EXIT_GRACE_S if cause is not None else 0
        gone = multiprocessing.connection.wait(list(sentinels), timeout=grace)
        if gone:
            raise WorkerLostError(self._describe_exit(sentinels[gone[0]])) from cause

    def _watch(self) -> None:
        """On a GPU: once a worker exits (unless told to), abort the group, so that rank 0,
        which may be waiting for a step's results on the device, fails instead of waiting for
        the NCCL timeout; the step's error then names the worker (`check_alive`)."""
        multiprocessing.connection.wait([worker.process.sentinel for worker in self._workers])
        group = self.group
        if not self._closing and group is not None:
            logger.error("a tensor-parallel worker exited; aborting the group's collectives")
            group.abort()

    def close(self) -> None:
        """Stop the workers (each told to, then terminated past STOP_TIMEOUT_S) and join
        them; let go of the group and the store."""
        self._closing = True
        for worker in self._workers:
            try:
                worker.conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass  # already gone
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in self._workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                logger.warning("tensor-parallel rank %d did not stop; terminating it", worker.rank)
                worker.process.terminate()
                worker.process.join()
            worker.conn.close()
        self._workers.clear()
        if self.group is not None:
            self.group.close()
            self.group = None
        self._store = None

    def _wait_for(self, kind: str, timeout_s: float) -> dict[int, object]:
        """Each worker's next message, which must be ``kind``: its payloads by rank. Raises if
        a worker fails, dies or stays silent past ``timeout_s``."""
        pending = {worker.conn: worker for worker in self._workers}
        sentinels = {worker.process.sentinel: worker for worker in self._workers}
        payloads: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(worker.rank for worker in pending.values())
                raise WorkerLostError(
                    f"tensor-parallel ranks {ranks} did not report {kind!r} within {timeout_s:.0f} s"
                )
            for ready in multiprocessing.connection.wait([*pending, *sentinels], timeout=left):
                if ready in sentinels:
                    worker = sentinels[ready]
                    if worker.conn in pending and worker.conn.poll():
                        continue  # read what it said before it exited first
                    raise WorkerLostError(self._describe_exit(worker))
                worker = pending[ready]
                message = _receive(worker)
                if message is None or message[0] != kind:
                    raise WorkerLostError(self._describe_exit(worker, wait=True))
                payloads[worker.rank] = message[1] if len(message) > 1 else None
                del pending[ready]
        return payloads

    def _describe_exit(self, worker: _Worker, wait: bool = False) -> str:
        """Why ``worker`` is gone: its exit code and what it said, if it said anything."""
        if worker.error is None and worker.conn.poll():
            _receive(worker)
        worker.process.join(STOP_TIMEOUT_S if wait else EXIT_GRACE_S)  # its exit code
        code = worker.process.exitcode
        how = "is still running" if code is None else f"exited with code {code}"
        said = f": {worker.error}" if worker.error else ""
        return f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) {how}{said}"


def _receive(worker: _Worker) -> tuple | None:
    """The worker's next message (None: its end of the pipe is closed); a failure it reports
    is kept as its error."""
    try:
        message = worker.conn.recv()
    except (EOFError, OSError):
        return None
    if message[0] == "failed":
        worker.error = message[1]
    return message


def _on_device(config: EngineConfig, device: torch.device) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(config, device=str(device))
