"""The engine process: holds the configured models and steps them for as long as the front end
lives.

One loop, one thread:

1. take every message the front end sent (add, abort, model command, shutdown) without
   blocking;
2. let the model pool finish transitions (loads, sleeps, wakes run on its worker thread), time
   out requests whose model did not come up, and put idle models to sleep;
3. step every loaded model that has work, one step each (`ember.engine.model_pool`: the
   interleaving policy);
4. send one message with every request that changed, plus stats now and then, and model states
   whenever one changed;
5. with no work anywhere, block on the socket until a message arrives or the pool has
   something due (never spin).

It speaks token ids only; text, chat templates and HTTP live in the front end. Started by the
front end through `ember.engine.launch.start_engine_process` (multiprocessing, spawn; kept out
of this module so the front end never imports torch), or by hand with
`python -m ember.engine.engine_core` for debugging.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ember.config import EngineConfig, MemoryConfig
from ember.dependencies import MissingDependencyError
from ember.engine.gc_heap import SLOW_PASS_S, GcPauses, freeze_startup_heap
from ember.engine.ipc import (
    AbortRequests,
    AddRequest,
    CommandDone,
    EngineChannel,
    EngineFailed,
    EngineGc,
    EngineReady,
    FrontendMessage,
    IpcAddresses,
    LoadProgress,
    ModelCommand,
    ModelStates,
    ModelStats,
    RequestRejected,
    Shutdown,
    StepOutputs,
    UnreadableRequest,
)
from ember.engine.model_pool import (
    CommandResult,
    ModelPool,
    ModelState,
    ModelUnavailableError,
    UnknownModelError,
)

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5  # how often stats ride along with outputs while busy
PROGRESS_INTERVAL_S = 0.1  # how often load progress is reported


class LoadProgressBoard:
    """Weight tensors loaded so far, per model, written by the loading thread and sent by the
    engine loop (the only thread that may use the socket)."""

    def __init__(self, totals: dict[str, int | None]) -> None:
        self._totals = totals
        self._done: dict[str, int] = {}
        self._sent: dict[str, int] = {}
        self._lock = threading.Lock()
        self._sent_at = 0.0

    def reporter(self, model: str) -> Callable[[int], None]:
        def report(done: int) -> None:
            with self._lock:
                self._done[model] = done

        return report

    def due(self, force: bool = False) -> list[LoadProgress]:
        """Progress not sent yet (at most every PROGRESS_INTERVAL_S unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._sent_at < PROGRESS_INTERVAL_S:
            return []
        with self._lock:
            changed = {m: d for m, d in self._done.items() if self._sent.get(m) != d}
        self._sent.update(changed)
        self._sent_at = now
        return [LoadProgress(m, d, self._totals.get(m)) for m, d in changed.items()]


class EngineCore:
    """The model pool and the loop that steps it."""

    def __init__(
        self,
        pool: ModelPool,
        channel: EngineChannel,
        progress: LoadProgressBoard | None = None,
        timeline: dict[str, float] | None = None,
    ) -> None:
        self.pool = pool
        # Wall-clock moments of this process's start (`ember bench startup` reads them from the
        # log line written when the engine is ready).
        self.timeline = dict(timeline or {})
        self.channel = channel
        self.progress = progress
        self._stats_sent_at = 0.0
        self._stats_dirty = True
        self._running = True
        self._ready_sent = False
        self.failed = False  # every model failed to load at start
        self._done: list[CommandDone] = []
        self._gc_pauses = GcPauses(slow_pass_s=SLOW_PASS_S)  # a slow pass is logged

    def run(self) -> None:
        """Serve until told to shut down or the parent process dies."""
        with self._gc_pauses:
            self._loop()

    def _loop(self) -> None:
        pool = self.pool
        while self._running:
            if not self._ready_sent and not self._announce_ready():
                return
            busy = pool.has_work()
            if not busy and self._stats_dirty:
                self._send(StepOutputs(updates=[], stats=self.stats()))  # settle the gauges
            messages = self.channel.receive(block=not busy, timeout_s=pool.next_deadline())
            if not self.channel.parent_alive:
                logger.info("the front-end process is gone; the engine exits")
                return
            rejected = self._handle(messages)
            pool.poll()
            updates = pool.step()
            rejected += [
                RequestRejected(r.request_id, r.message, r.retry_after_s)
                for r in pool.take_rejections()
            ]
            self._send_progress_and_states()
            if updates or rejected or messages:
                self._stats_dirty = True
            if updates or rejected or self._stats_due():
                stats = self.stats() if self._stats_due() else None
                self._send(StepOutputs(updates, rejected, stats))
            done, self._done = self._done, []
            for message in done:
                self.channel.send(message)

    def _announce_ready(self) -> bool:
        """Once the start-up loads are over, say so; False (after reporting) if every model
        failed to load."""
        if any(s.state is ModelState.LOADING for s in self.pool.slots.values()):
            return True
        self._send_progress_and_states(force=True)
        slots = list(self.pool.slots.values())
        if all(slot.state is ModelState.FAILED for slot in slots):
            missing = [s.failure for s in slots if isinstance(s.failure, MissingDependencyError)]
            if len(missing) == len(slots):  # a setup problem: its one line, as the only cause
                message = str(missing[0])
            else:
                message = "no model could be loaded: " + "; ".join(
                    f"{s.name}: {s.error}" for s in slots
                )
            logger.error("%s", message)
            self.channel.send(EngineFailed(message))
            self.failed = True
            return False
        # The loaded heap never becomes garbage; the collector's oldest pass must not walk it
        # between steps (ember.engine.gc_heap).
        frozen = freeze_startup_heap()
        logger.info("froze %d start-up objects out of the collector's passes", frozen)
        self.channel.send(EngineReady(self.pool.infos()))
        self._ready_sent = True
        self._log_timeline()
        return True

    def _log_timeline(self) -> None:
        """One log line: the start's moments and each loaded model's load report."""
        loads = {
            name: dataclasses.asdict(slot.instance.load_report)
            for name, slot in self.pool.slots.items()
            if slot.instance is not None
        }
        downloads = {
            name: dataclasses.asdict(download.stats)
            for name, slot in self.pool.slots.items()
            if slot.plan is not None
            and (download := getattr(slot.plan.checkpoint, "weight_files", None)) is not None
        }
        timeline = {
            **self.timeline,
            "engine_ready": time.time(),
            "loads": loads,
            "downloads": downloads,
        }
        logger.info("%s %s", STARTUP_TIMELINE_TAG, json.dumps(timeline))

    def _send_progress_and_states(self, force: bool = False) -> None:
        if self.progress is not None:
            for message in self.progress.due(force):
                self.channel.send(message)
        if self.pool.states_changed:
            self.pool.states_changed = False
            self.channel.send(ModelStates(self.pool.statuses()))

    def _handle(self, messages: list[FrontendMessage | UnreadableRequest]) -> list[RequestRejected]:
        rejected = []
        for message in messages:
            if isinstance(message, AddRequest):
                error = self._add(message)
                if error is not None:
                    rejected.append(error)
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    self.pool.abort(request_id)
            elif isinstance(message, ModelCommand):
                self._command(message)
            elif isinstance(message, Shutdown):
                self._running = False
            elif isinstance(message, UnreadableRequest):
                rejected.append(RequestRejected(message.request_id, message.message))
        return rejected

    def _add(self, message: AddRequest) -> RequestRejected | None:
        try:
            self.pool.add_request(
                message.model, message.request_id, message.prompt_token_ids, message.params
            )
        except UnknownModelError:
            return RequestRejected(message.request_id, f"the model {message.model!r} is not served")
        except ModelUnavailableError as exc:
            return RequestRejected(message.request_id, str(exc), retry_after_s=5.0)
        except ValueError as exc:
            return RequestRejected(message.request_id, str(exc))
        return None

    def _command(self, message: ModelCommand) -> None:
        def done(result: CommandResult) -> None:
            self._done.append(
                CommandDone(
                    message.command_id,
                    result.status,
                    result.message,
                    result.state,
                    result.seconds,
                )
            )

        try:
            self.pool.command(message.model, message.action, done)
        except UnknownModelError:
            done(CommandResult(404, f"the model {message.model!r} is not served", "", 0.0))

    def _stats_due(self) -> bool:
        return time.monotonic() - self._stats_sent_at >= STATS_INTERVAL_S

    def _send(self, message: StepOutputs) -> None:
        if message.stats is not None:
            self._stats_sent_at = time.monotonic()
            self._stats_dirty = False
            gc_pauses = self._gc_pauses
            message.gc = EngineGc(list(gc_pauses.collections), list(gc_pauses.pause_s))
        self.channel.send(message)

    def stats(self) -> list[ModelStats]:
        result = []
        for name, slot in self.pool.slots.items():
            instance = slot.instance
            if instance is None:
                result.append(ModelStats(name, 0, len(slot.queued), 0, 0, 0))
                continue
            scheduler, kv = instance.scheduler, instance.kv_manager
            capacity, steps = kv.pool.capacity, scheduler.step_counts
            result.append(
                ModelStats(
                    model=name,
                    num_running=len(scheduler.running),
                    num_waiting=len(scheduler.waiting),
                    kv_blocks_used=capacity - kv.num_free_blocks,
                    kv_blocks_total=capacity,
                    num_preemptions=scheduler.num_preemptions,
                    decode_only_steps=steps.decode_only_steps,
                    prefill_steps=steps.prefill_steps,
                    decode_tokens=steps.decode_tokens,
                    prefill_tokens=steps.prefill_tokens,
                    prefix_cache_queries=kv.stats.queries,
                    prefix_cache_hits=kv.stats.hits,
                )
            )
        return result


def _tensor_count(checkpoint: object) -> int | None:
    """How many tensors the checkpoint will yield, where it can tell cheaply."""
    count = getattr(checkpoint, "num_tensors", None)
    return int(count) if isinstance(count, int) else None


# ------------------------------------------------------------------------ process entry point

# Starts the log line that holds the start-up timeline (JSON), for `ember bench startup`.
STARTUP_TIMELINE_TAG = "startup timeline:"


def run_engine(
    configs: list[EngineConfig],
    addresses: IpcAddresses,
    memory: MemoryConfig | None = None,
    load_timeout_s: float = 300.0,
    timeline: dict[str, float] | None = None,
) -> None:
    """Body of the engine process: plan every model, start the configured loads, serve; report
    a failure before exiting. ``timeline``: the moments of the process's start so far."""
    # Ctrl+C reaches the whole process group; the front end decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    parent = multiprocessing.parent_process()
    channel = EngineChannel(addresses, parent.sentinel if parent is not None else None)
    try:
        timeline = dict(timeline or {})
        cuda_init = _start_cuda_init(configs, timeline)
        with ThreadPoolExecutor(1, thread_name_prefix="model-transition") as worker:
            pool = ModelPool([], memory or MemoryConfig(), worker, load_timeout_s)
            for config in configs:
                pool.add_model(config, isolate_failure=len(configs) > 1)
            timeline["models_planned"] = time.time()
            if cuda_init is not None:
                cuda_init.join()
            totals = {
                name: _tensor_count(slot.plan.checkpoint)
                for name, slot in pool.slots.items()
                if slot.plan is not None
            }
            board = LoadProgressBoard(totals)
            pool.set_progress(board.reporter)
            for name, total in totals.items():
                channel.send(LoadProgress(name, 0, total))
            pool.preload()
            core = EngineCore(pool, channel, board, timeline)
            core.run()
    except MissingDependencyError as exc:  # a setup problem, said in one line: no traceback
        logger.error("%s", exc)
        channel.send(EngineFailed(str(exc)))
        raise SystemExit(1) from exc
    except BaseException as exc:
        logger.exception("engine failed")
        channel.send(EngineFailed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from exc
    finally:
        channel.close()
    if core.failed:
        raise SystemExit(1)


def _start_cuda_init(configs: list[EngineConfig], timeline: dict[str, float]):
    """Initialise CUDA (~0.5 s and more) on a thread while the models are planned (and their
    object-store downloads start); None on a machine without a GPU or a CPU-only config."""
    import torch

    if all(config.device == "cpu" for config in configs) or not torch.cuda.is_available():
        return None

    def init() -> None:
        timeline["cuda_init_started"] = time.time()
        torch.cuda.init()
        timeline["cuda_initialised"] = time.time()

    thread = threading.Thread(target=init, name="cuda-init", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    """`python -m ember.engine.engine_core --requests ADDR --outputs ADDR [MODEL]`: run an
    engine against an already-listening front end (for debugging)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--requests", required=True)
    parser.add_argument("--outputs", required=True)
    parser.add_argument("--served-model-name")
    args = parser.parse_args(argv)
    config = EngineConfig(model=args.model, served_model_name=args.served_model_name)
    run_engine([config], IpcAddresses(args.requests, args.outputs))


if __name__ == "__main__":
    main()
