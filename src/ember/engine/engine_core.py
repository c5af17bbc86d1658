"""The engine process: loads the served models and steps them for as long as the front end lives.

One loop, one thread:

1. take every message the front end sent (add, abort, shutdown) without blocking;
2. step every model instance that has work, one step each (several models interleave);
3. send one message with every request that changed, plus stats now and then;
4. with no work anywhere, block on the socket until a message arrives (never spin).

It speaks token ids only; text, chat templates and HTTP live in the front end. Started by the
front end through `ember.engine.launch.start_engine_process` (multiprocessing, spawn; kept out
of this module so the front end never imports torch), or by hand with
`python -m ember.engine.engine_core` for debugging.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from ember.config import EngineConfig
from ember.dependencies import MissingDependencyError
from ember.engine.gc_heap import SLOW_PASS_S, GcPauses, freeze_startup_heap
from ember.engine.ipc import (
    AbortRequests,
    AddRequest,
    EngineChannel,
    EngineFailed,
    EngineGc,
    EngineReady,
    FrontendMessage,
    IpcAddresses,
    LoadProgress,
    ModelInfo,
    ModelStats,
    RequestRejected,
    Shutdown,
    StepOutputs,
)
from ember.engine.model_instance import ModelInstance

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5  # how often stats ride along with outputs while busy
PROGRESS_INTERVAL_S = 0.1  # how often load progress is reported


class EngineCore:
    """The served model instances, by served name, and the loop that steps them."""

    def __init__(self, instances: dict[str, ModelInstance], channel: EngineChannel) -> None:
        self.instances = instances
        self.channel = channel
        self._stats_sent_at = 0.0
        self._stats_dirty = True
        self._running = True
        self._gc_pauses = GcPauses(slow_pass_s=SLOW_PASS_S)  # a slow pass is logged

    def run(self) -> None:
        """Serve until told to shut down or the parent process dies."""
        with self._gc_pauses:
            self._loop()

    def _loop(self) -> None:
        while self._running:
            busy = any(instance.has_work() for instance in self.instances.values())
            if not busy and self._stats_dirty:
                self._send(StepOutputs(updates=[], stats=self.stats()))  # settle the gauges
            messages = self.channel.receive(block=not busy)
            if not self.channel.parent_alive:
                logger.info("the front-end process is gone; the engine exits")
                return
            rejected = self._handle(messages)
            updates = []
            for instance in self.instances.values():
                if instance.has_work():
                    updates.extend(instance.step())
            if updates or rejected or messages:
                self._stats_dirty = True
            if updates or rejected or self._stats_due():
                stats = self.stats() if self._stats_due() else None
                self._send(StepOutputs(updates, rejected, stats))

    def _handle(self, messages: list[FrontendMessage]) -> list[RequestRejected]:
        rejected = []
        for message in messages:
            if isinstance(message, AddRequest):
                error = self._add(message)
                if error is not None:
                    rejected.append(error)
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    for instance in self.instances.values():
                        if instance.abort(request_id):
                            break
            elif isinstance(message, Shutdown):
                self._running = False
        return rejected

    def _add(self, message: AddRequest) -> RequestRejected | None:
        instance = self.instances.get(message.model)
        if instance is None:
            return RequestRejected(message.request_id, f"the model {message.model!r} is not served")
        try:
            instance.add_request(message.request_id, message.prompt_token_ids, message.params)
        except ValueError as exc:
            return RequestRejected(message.request_id, str(exc))
        return None

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
        for name, instance in self.instances.items():
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
                )
            )
        return result


# ------------------------------------------------------------------------ loading


class _ThrottledProgress:
    """Sends LoadProgress for one model at most every PROGRESS_INTERVAL_S (and at the end)."""

    def __init__(self, model: str, total: int | None, send: Callable[[LoadProgress], None]):
        self.model, self.total, self._send = model, total, send
        self._sent_at = 0.0

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self._sent_at >= PROGRESS_INTERVAL_S or done == self.total:
            self._sent_at = now
            self._send(LoadProgress(self.model, done, self.total))


def load_instances(
    configs: list[EngineConfig], report: Callable[[LoadProgress], None]
) -> dict[str, ModelInstance]:
    """Load every configured model, reporting progress per weight tensor (throttled)."""
    from ember.weights.resolve import open_checkpoint

    instances: dict[str, ModelInstance] = {}
    for config in configs:
        name = config.served_model_name or config.model or "default"
        if name in instances:
            raise ValueError(f"two models are served under the name {name!r}")
        checkpoint = open_checkpoint(config.model)
        progress = _ThrottledProgress(name, _tensor_count(checkpoint), report)
        progress(0)
        # The progress is sent from the instance's weight-loading thread; nothing else uses the
        # engine's socket until the instance is built (a join between, so handing the socket
        # over is safe for zmq).
        instances[name] = ModelInstance(config, checkpoint=checkpoint, on_tensor_loaded=progress)
    return instances


def _tensor_count(checkpoint: Any) -> int | None:
    """How many tensors `iter_tensors` will yield, where the checkpoint can tell cheaply."""
    count = getattr(checkpoint, "num_tensors", None)
    return int(count) if isinstance(count, int) else None


def model_info(name: str, instance: ModelInstance) -> ModelInfo:
    return ModelInfo(
        name=name,
        max_model_len=instance.max_model_len,
        vocab_size=instance.model_config.vocab_size,
        num_kv_blocks=instance.load_report.num_blocks,
        block_size=instance.kv_manager.block_size,
        load_seconds=instance.load_report.seconds,
    )


# ------------------------------------------------------------------------ process entry point


def run_engine(configs: list[EngineConfig], addresses: IpcAddresses) -> None:
    """Body of the engine process: load, announce, serve; report a failure before exiting."""
    # Ctrl+C reaches the whole process group; the front end decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    parent = multiprocessing.parent_process()
    channel = EngineChannel(addresses, parent.sentinel if parent is not None else None)
    try:
        instances = load_instances(configs, channel.send)
        # The loaded heap never becomes garbage; the collector's oldest pass must not walk it
        # between steps (ember.engine.gc_heap).
        frozen = freeze_startup_heap()
        logger.info("froze %d start-up objects out of the collector's passes", frozen)
        channel.send(EngineReady([model_info(name, inst) for name, inst in instances.items()]))
        EngineCore(instances, channel).run()
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
