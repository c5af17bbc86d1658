"""Several models in one engine: their states, the memory budget they share, loading on demand,
sleep and wake, and the order in which they step.

Each configured model is in one state: ``unloaded -> loading -> loaded <-> sleeping``
(``waking`` on the way back; ``failed`` when a load raised). The pool is driven by one thread
(the engine loop, or the offline API's caller) and does the slow work (loading, copying weights
to and from host memory) through an executor: one worker thread in the server, so other models
keep stepping meanwhile; inline in the offline API. Transitions run one at a time, in the order
they were decided, so a sleep that makes room always finishes before the load that needs it.

Policies, in one place:

- **Memory.** `MemoryBudget` charges a loaded model its weights, KV cache and reserve (activations,
  logits, graph pool) and a sleeping one what stays on the device (its input buffers and graph
  pool where the graphs are kept). A model's KV cache is sized once, at its first load: its
  ``kv_cache_memory_bytes`` (or block count) if set, else its ``memory_share`` of the budget, else
  an equal share per configured model (all of the budget for a single model); never below one
  sequence of its context.
- **Eviction.** A load or wake that does not fit puts the unpinned loaded model with the fewest
  requests (then the least recently used) to sleep (its running requests are preempted and
  resume after wake), then the next, and unloads sleeping models that still hold memory; a
  model with requests is evicted only after its time slice (``min_residency_s``); if everything
  evictable would not make room, the load is refused with an error and nothing is evicted.
  A tensor-parallel model is never put to sleep (its sleep and wake are not built yet): it is
  evicted as a pinned one is, never, and its ``sleep`` command is refused.
- **Idle.** A loaded model with an idle timeout and no requests for that long sleeps.
- **Interleaving.** Every loaded model with work steps once per engine iteration, in a fixed
  order (round-robin). A step is bounded by its model's token budget, so one model's prefill
  delays another's decode by at most one step, and every model progresses.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from ember.config import EngineConfig, MemoryConfig
from ember.dependencies import MissingDependencyError
from ember.engine.device_arena import ArenaFactory
from ember.engine.host_stash import HostStash
from ember.engine.ipc import ModelInfo, ModelStatus, TransitionCounts
from ember.engine.memory_budget import MemoryBudget
from ember.engine.model_instance import ModelInstance
from ember.engine.model_plan import (
    CPU_KV_BYTES_DEFAULT,
    ModelPlan,
    new_request,
    plan_model,
    validate_prompt,
)
from ember.engine.request import Request
from ember.engine.step_types import RequestUpdate
from ember.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A loaded model with requests keeps its memory at least this long before another model's
# requests may evict it: the time slice of models that do not fit together. A swap costs a
# sleep and a wake (about 0.7 s for an 8B from pinned memory) and the recompute of the victim's
# preempted requests (seconds at a full batch): the slice must dwarf it, or models that all
# have traffic spend their time swapping (bench/results/README.md, "multi-model traffic").
MIN_RESIDENCY_S = 10.0


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    SLEEPING = "sleeping"
    WAKING = "waking"
    FAILED = "failed"


class UnknownModelError(KeyError):
    """A request or command named a model that is not configured."""


class ModelUnavailableError(Exception):
    """A request's model cannot serve it now (failed, or does not fit); worth retrying later."""


@dataclass
class Rejection:
    """A request the pool gave up on: ``retry_after_s`` set when its model was not ready."""

    request_id: str
    message: str
    retry_after_s: float | None = None


@dataclass
class CommandResult:
    status: int  # HTTP-shaped: 200, 409, 503
    message: str
    state: str
    seconds: float


@dataclass
class _Slot:
    """One configured model and everything the pool tracks about it. ``plan`` is None when
    its checkpoint could not even be opened (the slot is failed)."""

    name: str
    config: EngineConfig
    plan: ModelPlan | None
    rng: random.Random
    state: ModelState = ModelState.UNLOADED
    instance: ModelInstance | None = None
    queued: deque[Request] = field(default_factory=deque)  # before the instance exists
    last_used: float = 0.0
    loaded_at: float = 0.0  # when it last became loaded (its time slice starts)
    error: str | None = None
    failure: Exception | None = None  # what the last failed load raised
    kv_cache_bytes: int | None = None  # fixed at the first load
    transition: Future | None = None
    counters: TransitionCounts = field(default_factory=TransitionCounts)
    waiters: list[Callable[[], None]] = field(default_factory=list)

    @property
    def policy(self):
        return self.config.policy

    @property
    def sleeps(self) -> bool:
        """Whether the pool may put it to sleep (idle, or to make room): not when pinned, nor
        when split over several GPUs, whose sleep and wake are not built yet."""
        return not self.policy.pinned and self.config.tensor_parallel_size == 1

    def request_count(self) -> int:
        held = len(self.instance.scheduler.requests) if self.instance is not None else 0
        return held + len(self.queued)


class InlineExecutor(Executor):
    """Runs each submitted call at once, on the caller's thread (the offline API)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - the future hands it to whoever reads it
            future.set_exception(exc)
        return future


def device_is_broken(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the GPU context unusable (an illegal address, a device-side
    assert: every later CUDA call fails), so only a new process recovers."""
    text = f"{type(exc).__name__}: {exc}"
    return "AcceleratorError" in text or "CUDA error" in text or "CUBLAS_STATUS" in text


def _log_pinning(done: Future) -> None:
    exc = done.exception()
    if exc is not None:  # the first sleeps pin as they go instead
        logger.warning("pinning host memory ahead for sleeping models failed: %r", exc)
    else:
        logger.info("pinned %.1f GB of host memory ahead for sleeping models", done.result() / 1e9)


class ModelPool:
    """The configured models of one engine, by served name."""

    def __init__(
        self,
        configs: list[EngineConfig],
        memory: MemoryConfig,
        executor: Executor | None = None,
        load_timeout_s: float = 300.0,
        min_residency_s: float = MIN_RESIDENCY_S,
    ) -> None:
        self.memory = memory
        self.load_timeout_s = load_timeout_s
        self.min_residency_s = min_residency_s
        self._executor = executor or InlineExecutor()
        self._progress: Callable[[str], Callable[[int], None] | None] = lambda name: None
        self.slots: dict[str, _Slot] = {}
        # Sized for the device of the first model planned (every model shares one device).
        self.budget = MemoryBudget(None)
        self.arenas = ArenaFactory(torch.device("cpu"))
        self._device: torch.device | None = None
        self.stash = HostStash(memory.sleep_host_memory_bytes)
        self._owner: dict[str, _Slot] = {}  # request id -> its model's slot
        self._pinning: Future | None = None  # host memory pinned ahead (`_pin_ahead`)
        self._rejections: list[Rejection] = []
        self._updates: list[RequestUpdate] = []
        self.states_changed = True
        for config in configs:
            self.add_model(config)

    def add_model(self, config: EngineConfig, isolate_failure: bool = False) -> str:
        """Configure one more model (planned now, loaded on demand); its served name. A
        checkpoint that cannot be opened raises, or with ``isolate_failure`` (a server of
        several models) leaves the model failed, its requests answered with the error."""
        name = config.served_model_name or config.model or "default"
        if name in self.slots:
            raise ValueError(f"two models are served under the name {name!r}")
        slot = _Slot(name, config, None, random.Random(config.seed))
        try:
            slot.plan = plan_model(config)
        except (OSError, ValueError) as exc:
            if not isolate_failure:
                raise
            logger.error("%s cannot be served: %s", name, exc)
            slot.state, slot.error, slot.failure = ModelState.FAILED, str(exc), exc
        if self._device is None and slot.plan is not None:
            self._device = slot.plan.device
            self.budget = MemoryBudget.for_device(self.memory, self._device)
            self.arenas = ArenaFactory(self._device)
        self.slots[name] = slot
        self.states_changed = True
        return name

    def set_progress(self, reporter: Callable[[str], Callable[[int], None] | None]) -> None:
        """``reporter(name)`` gives the callback a load of ``name`` calls, from the loading
        thread, as each weight tensor lands."""
        self._progress = reporter

    # -- what the front end sees -----------------------------------------------------------------

    def infos(self) -> list[ModelInfo]:
        return [
            ModelInfo(
                name=slot.name,
                max_model_len=slot.plan.max_model_len,
                vocab_size=slot.plan.model_config.vocab_size,
                block_size=slot.plan.config.cache.block_size,
            )
            for slot in self.slots.values()
            if slot.plan is not None
        ]

    def statuses(self) -> list[ModelStatus]:
        return [self._status(slot) for slot in self.slots.values()]

    def _status(self, slot: _Slot) -> ModelStatus:
        inst, counters = slot.instance, slot.counters
        stashed = inst is not None and inst.asleep and inst.weights_stashed
        return ModelStatus(
            model=slot.name,
            state=slot.state.value,
            pinned=slot.policy.pinned,
            weight_bytes=inst.weight_bytes if inst is not None else 0,
            kv_cache_bytes=inst.kv_cache_bytes if inst is not None else 0,
            num_kv_blocks=inst.kv_manager.pool.num_blocks if inst is not None else 0,
            device_bytes=self.budget.held_by(slot.name),
            host_bytes=inst.weight_bytes if stashed else 0,
            transitions=counters,
            error=slot.error,
        )

    def loaded(self) -> list[ModelInstance]:
        return [
            slot.instance
            for slot in self.slots.values()
            if slot.state is ModelState.LOADED and slot.instance is not None
        ]

    def instance(self, name: str) -> ModelInstance | None:
        return self._slot(name).instance

    def state(self, name: str) -> ModelState:
        return self._slot(name).state

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self, model: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        """Validate and queue a request on its model, starting the model's load or wake if it
        is not loaded. UnknownModelError, ValueError (bad input) or ModelUnavailableError
        (a failed model); nothing is queued then."""
        slot = self._slot(model)
        if slot.state is ModelState.FAILED:
            raise ModelUnavailableError(f"the model {model} failed to load: {slot.error}")
        validate_prompt(slot.plan, prompt_token_ids, params)
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = new_request(slot.plan, slot.rng, request_id, prompt_token_ids, params)
        if slot.instance is not None:
            slot.instance.scheduler.add_request(request)
        else:
            slot.queued.append(request)
        self._owner[request_id] = slot
        slot.last_used = time.monotonic()
        if slot.state in (ModelState.UNLOADED, ModelState.SLEEPING) and slot.transition is None:
            self._bring_up(slot)
        return request

    def abort(self, request_id: str) -> bool:
        slot = self._owner.pop(request_id, None)
        if slot is None:
            return False
        for request in slot.queued:
            if request.request_id == request_id:
                slot.queued.remove(request)
                return True
        return slot.instance is not None and slot.instance.abort(request_id)

    def has_work(self) -> bool:
        """Whether a loaded model has requests to step."""
        return any(instance.has_work() for instance in self.loaded())

    def transitions_pending(self) -> bool:
        return any(slot.transition is not None for slot in self.slots.values())

    def step(self) -> list[RequestUpdate]:
        """One step of every loaded model with work (round-robin); what changed."""
        updates, now = self._take_updates(), time.monotonic()
        for slot in self.slots.values():
            instance = slot.instance
            if slot.state is ModelState.LOADED and instance is not None and instance.has_work():
                slot.last_used = now
                try:
                    updates.extend(instance.step())
                except Exception as exc:
                    if device_is_broken(exc):
                        raise  # the whole process must go: the front end starts a new one
                    self._step_failed(slot, exc)
                    continue
                for request_id, message in instance.take_failed_requests():
                    self._rejections.append(Rejection(request_id, message))
        for update in updates:
            if update.finish_reason is not None:
                self._owner.pop(update.request_id, None)
        return updates

    def take_rejections(self) -> list[Rejection]:
        rejections, self._rejections = self._rejections, []
        for rejection in rejections:
            self._owner.pop(rejection.request_id, None)
        return rejections

    def _take_updates(self) -> list[RequestUpdate]:
        updates, self._updates = self._updates, []
        return updates

    # -- housekeeping, each engine iteration -----------------------------------------------------

    def poll(self) -> None:
        """Finish transitions that are done, time out requests that waited too long for their
        model, and put models idle past their timeout to sleep."""
        for slot in self.slots.values():
            if slot.transition is not None and slot.transition.done():
                self._finish_transition(slot)
        now = time.monotonic()
        self._bring_up_waiting()
        for slot in self.slots.values():
            if slot.state is not ModelState.LOADED:
                self._time_out_waiting(slot, now)
            elif (
                slot.policy.idle_timeout_s is not None
                and slot.sleeps
                and slot.request_count() == 0
                and now - slot.last_used >= slot.policy.idle_timeout_s
            ):
                logger.info("%s idle for %.0f s: sleeping", slot.name, now - slot.last_used)
                self._sleep(slot)

    def _bring_up_waiting(self) -> None:
        """Load or wake models that have requests, the one waiting longest first."""
        waiting = [
            slot
            for slot in self.slots.values()
            if slot.transition is None
            and slot.state in (ModelState.UNLOADED, ModelState.SLEEPING)
            and slot.request_count()
        ]
        waiting.sort(key=self._oldest_arrival)
        for slot in waiting:
            if self._bring_up(slot) is None:
                return  # the next one would take the memory this one is waiting for

    @staticmethod
    def _oldest_arrival(slot: _Slot) -> float:
        requests = list(slot.queued)
        if slot.instance is not None:
            requests += list(slot.instance.scheduler.requests.values())
        return min((r.arrival_time for r in requests), default=float("inf"))

    def next_deadline(self) -> float | None:
        """Seconds until `poll` has something to do on its own (None: nothing scheduled)."""
        if self.transitions_pending():
            return 0.01
        now, deadlines = time.monotonic(), []
        for slot in self.slots.values():
            timeout = slot.policy.idle_timeout_s
            if slot.state is ModelState.LOADED and timeout is not None and slot.sleeps:
                deadlines.append(slot.last_used + timeout - now)
            elif slot.request_count():
                # Requests waiting for a model: it may get its time slice soon, and their
                # timeout needs checking.
                deadlines.append(0.05)
        return max(0.0, min(deadlines)) if deadlines else None

    # -- commands --------------------------------------------------------------------------------

    def command(self, model: str, action: str, done: Callable[[CommandResult], None]) -> None:
        """Start ``action`` on ``model``; ``done`` is called (from `poll` or at once) with the
        result when the model has reached its new state."""
        slot = self._slot(model)
        started = time.monotonic()

        def finish(status: int = 200, message: str = "ok") -> None:
            done(CommandResult(status, message, slot.state.value, time.monotonic() - started))

        if slot.transition is not None:
            # One transition at a time per model: answer once the current one is over.
            slot.waiters.append(lambda: self.command(model, action, done))
            return
        state = slot.state
        if action in ("load", "wake"):
            if state is ModelState.LOADED:
                return finish(message=f"{model} is already loaded")
            if action == "wake" and state is not ModelState.SLEEPING:
                return finish(409, f"{model} is {state.value}, not sleeping")
            if state is ModelState.FAILED:
                if slot.plan is None:
                    try:
                        slot.plan = plan_model(slot.config)
                    except (OSError, ValueError) as exc:
                        slot.error = str(exc)
                        return finish(503, f"{model} cannot be served: {exc}")
                slot.state, slot.error = ModelState.UNLOADED, None
            outcome = self._bring_up(slot, force=True)
            if outcome is None:
                return finish(503, "the models it would evict are changing state; retry")
            if not outcome:
                return finish(503, slot.error or f"{model} does not fit")
        elif action == "sleep":
            if state is not ModelState.LOADED:
                return finish(409, f"{model} is {state.value}, not loaded")
            if slot.config.tensor_parallel_size > 1:
                return finish(
                    409,
                    f"{model} is split over {slot.config.tensor_parallel_size} GPUs; sleep and "
                    "wake of a tensor-parallel model are not supported yet (unload it instead)",
                )
            self._sleep(slot)
        elif action == "unload":
            if state in (ModelState.UNLOADED, ModelState.FAILED):
                return finish(message=f"{model} is not loaded")
            self._unload(slot, "unloaded by request")
        else:
            return finish(400, f"unknown action {action!r}")
        if slot.transition is None:
            return finish(*self._outcome(slot))
        slot.waiters.append(lambda: finish(*self._outcome(slot)))

    def failure(self, name: str) -> Exception | None:
        """What the last failed load of ``name`` raised (the offline API raises it again)."""
        return self._slot(name).failure

    def _outcome(self, slot: _Slot) -> tuple[int, str]:
        if slot.state is ModelState.FAILED:
            return 503, f"{slot.name} failed to load: {slot.error}"
        return 200, "ok"

    # -- start-up --------------------------------------------------------------------------------

    def preload(self) -> None:
        """Start loading, in order, each model configured to preload that fits without evicting
        another (the rest load on their first request)."""
        for slot in self.slots.values():
            if not slot.policy.preload or slot.plan is None:
                continue
            if not self.budget.fits(self._footprint(slot)):
                logger.info(
                    "%s does not fit beside the models before it: loads on demand", slot.name
                )
                continue
            self._bring_up(slot)
        self._pin_ahead()

    def _pin_ahead(self) -> None:
        """Where the configured models cannot all be loaded at once, models will sleep: pin
        host memory for the largest one's weights now, on the worker (after the preloads, before
        any sleep), so that no sleep waits seconds for pinning. Only under an explicit
        ``sleep_host_memory_bytes``: the user set the host memory sleeping models may take."""
        evictable = [slot for slot in self.slots.values() if slot.plan is not None and slot.sleeps]
        total = self.budget.total_bytes
        if (
            self.memory.sleep_host_memory_bytes is None
            or self._device is None
            or self._device.type != "cuda"
            or not evictable
            or total is None
            or sum(self._footprint(slot) for slot in self.slots.values() if slot.plan) <= total
        ):
            return
        largest = max(slot.plan.weight_bytes for slot in evictable)
        self._pinning = self._executor.submit(self.stash.reserve, largest, self._device)
        self._pinning.add_done_callback(_log_pinning)

    def wait_transitions(self) -> None:
        """Block until every transition in flight is done (start-up, tests, shutdown)."""
        while self.transitions_pending():
            for slot in self.slots.values():
                if slot.transition is not None:
                    slot.transition.exception()  # waits
            self.poll()

    def close(self) -> None:
        """Unload every model now and close the checkpoints: each one's device memory goes back
        at once, not when the garbage collector finds it (the pool is done)."""
        self.wait_transitions()
        for slot in self.slots.values():
            instance, slot.instance = slot.instance, None
            if instance is not None:
                instance.close(self.stash)
            if slot.plan is not None:
                slot.plan.close()
            slot.state = ModelState.UNLOADED
            self.budget.hold(slot.name, 0)
        self.states_changed = True

    # -- transitions -----------------------------------------------------------------------------

    def _bring_up(self, slot: _Slot, force: bool = False) -> bool | None:
        """Load or wake ``slot``, evicting what must go. True: started; None: not now (the
        models it would evict have not had their time slice; `poll` tries again); False: it
        cannot fit even after evicting everything unpinned (``slot.error`` set, its waiting
        requests rejected). ``force`` (a command): evict without waiting for time slices."""
        need = self._footprint(slot) - self.budget.held_by(slot.name)
        victims, possible = self._victims(slot, need, force)
        if not possible:
            free = self.budget.free_bytes
            slot.error = (
                f"{slot.name} needs {need / 2**30:.2f} GiB and only {free / 2**30:.2f} GiB are "
                "free in the memory budget, even after putting every unpinned model to sleep"
            )
            logger.error("cannot load: %s", slot.error)
            self._reject_waiting(slot, slot.error, retry_after_s=5.0)
            self.states_changed = True
            return False
        if victims is None:
            return None
        for victim in victims:
            if victim.state is ModelState.LOADED:
                self._sleep(victim)
            else:
                self._unload(victim, f"unloaded to make room for {slot.name}")
        slot.error, slot.failure = None, None
        if slot.kv_cache_bytes is None:
            slot.kv_cache_bytes = self._kv_cache_bytes(slot)
        self.budget.hold(slot.name, self._footprint(slot))
        if slot.instance is None:
            slot.state = ModelState.LOADING
            slot.transition = self._executor.submit(self._timed, self._load, slot)
        else:
            slot.state = ModelState.WAKING
            slot.transition = self._executor.submit(self._timed, slot.instance.wake, self.stash)
        self.states_changed = True
        self._finish_if_inline(slot)
        return True

    def _victims(self, slot: _Slot, need: int, force: bool) -> tuple[list[_Slot] | None, bool]:
        """Models to evict, least recently used first, so that ``need`` more bytes fit, and
        whether evicting every unpinned model could ever make room. The list is None when
        room can be made but not now: a candidate is in a transition, or a loaded model with
        requests has not yet served its time slice (``min_residency_s``), which keeps two
        models that do not fit together from evicting each other before either steps."""
        free = self.budget.free_bytes
        if free is None or need <= free:
            return [], True
        others = [o for o in self.slots.values() if o is not slot and o.sleeps]
        if need > free + sum(self._gain(o) for o in others):
            return None, False
        now = time.monotonic()
        candidates = [
            other
            for other in others
            if other.transition is None
            and other.state in (ModelState.LOADED, ModelState.SLEEPING)
            and (
                force
                or other.state is ModelState.SLEEPING
                or other.request_count() == 0
                or now - other.loaded_at >= self.min_residency_s
            )
        ]
        # Loaded models sleep first, those with the fewest requests first (the least work
        # preempted, and the busiest models stay), then the least recently used; sleeping ones
        # are unloaded only if that is still not enough (their graphs and buffers are what
        # they hold).
        candidates.sort(
            key=lambda s: (s.state is ModelState.SLEEPING, s.request_count(), s.last_used)
        )
        victims = []
        for other in candidates:
            if need <= free:
                break
            gain = self._gain(other)
            if gain > 0:
                victims.append(other)
                free += gain
        return (victims if need <= free else None), True

    def _gain(self, slot: _Slot) -> int:
        """Bytes evicting ``slot`` gives back: all it holds, but what stays resident while it
        sleeps if it is put to sleep rather than unloaded."""
        if slot.state is ModelState.SLEEPING:
            return self.budget.held_by(slot.name)
        return self.budget.held_by(slot.name) - self._resident(slot)

    def _sleep(self, slot: _Slot) -> None:
        instance = slot.instance
        assert instance is not None and slot.state is ModelState.LOADED
        self._updates.extend(instance.preempt_all())
        slot.state = ModelState.SLEEPING
        self.budget.hold(slot.name, self._resident(slot))
        slot.transition = self._executor.submit(self._timed, instance.sleep, self.stash)
        self.states_changed = True
        self._finish_if_inline(slot)

    def _unload(self, slot: _Slot, reason: str) -> None:
        instance = slot.instance
        if instance is not None and slot.state is ModelState.LOADED:
            self._updates.extend(instance.preempt_all())
        self._reject_waiting(slot, f"the model {slot.name} was {reason}", retry_after_s=1.0)
        slot.state = ModelState.UNLOADED
        slot.instance = None
        self.budget.hold(slot.name, 0)
        if instance is not None:
            slot.transition = self._executor.submit(self._timed, instance.close, self.stash)
        self.states_changed = True
        self._finish_if_inline(slot)

    def _load(self, slot: _Slot) -> ModelInstance:
        plan = slot.plan
        return ModelInstance(
            plan.config,
            on_tensor_loaded=self._progress(slot.name),
            plan=plan,
            kv_cache_bytes=slot.kv_cache_bytes,
            arenas=self.arenas,
        )

    @staticmethod
    def _timed(fn: Callable, *args) -> tuple[object, float]:
        started = time.perf_counter()
        result = fn(*args)
        return result, time.perf_counter() - started

    def _finish_if_inline(self, slot: _Slot) -> None:
        if isinstance(self._executor, InlineExecutor) and slot.transition is not None:
            self._finish_transition(slot)

    def _finish_transition(self, slot: _Slot) -> None:
        future, slot.transition = slot.transition, None
        counters = slot.counters
        try:
            result, seconds = future.result()
        except Exception as exc:
            if isinstance(exc, MissingDependencyError):  # a setup problem: one line says it
                logger.error("%s: %s", slot.name, exc)
            else:
                logger.exception("%s: %s failed", slot.name, slot.state.value)
            slot.failure = exc
            self._fail(slot, f"{type(exc).__name__}: {exc}")
        else:
            if slot.state is ModelState.LOADING:
                slot.instance = result
                for request in slot.queued:
                    result.scheduler.add_request(request)
                slot.queued.clear()
                self.budget.hold(slot.name, self._footprint(slot))
                slot.state, slot.error = ModelState.LOADED, None
                counters.loads += 1
                counters.load_seconds += seconds
                action = "load"
            elif slot.state is ModelState.WAKING:
                slot.state = ModelState.LOADED
                counters.wakes += 1
                counters.wake_seconds += seconds
                action = "wake"
            elif slot.state is ModelState.SLEEPING:
                counters.sleeps += 1
                counters.sleep_seconds += seconds
                action = "sleep"
            else:
                action = "unload"
            counters.last_action, counters.last_seconds = action, seconds
            logger.info("%s: %s in %.2f s", slot.name, action, seconds)
            if slot.state is ModelState.LOADED:
                slot.last_used = slot.loaded_at = time.monotonic()
        self.states_changed = True
        waiters, slot.waiters = slot.waiters, []
        for waiter in waiters:
            waiter()

    def _step_failed(self, slot: _Slot, exc: Exception) -> None:
        """A step of ``slot``'s model raised: end its requests with the error, and unload it
        (its scheduler and buffers may be half-updated); its next request loads it afresh.
        The other models go on serving."""
        logger.error("%s: a step failed; unloading it", slot.name, exc_info=exc)
        message = (
            f"the model {slot.name} failed in a step ({type(exc).__name__}: {exc}); "
            "it is loaded again on its next request"
        )
        self._reject_waiting(slot, message, retry_after_s=1.0)
        instance, slot.instance = slot.instance, None
        slot.state = ModelState.UNLOADED
        slot.error = message
        self.budget.hold(slot.name, 0)
        self.states_changed = True
        if instance is not None:
            slot.transition = self._executor.submit(self._timed, instance.close, self.stash)
            self._finish_if_inline(slot)

    def _fail(self, slot: _Slot, message: str) -> None:
        instance, slot.instance = slot.instance, None
        slot.state, slot.error = ModelState.FAILED, message
        self.budget.hold(slot.name, 0)
        self._reject_waiting(slot, f"the model {slot.name} failed to load: {message}", 1.0)
        if instance is not None:
            try:
                instance.close()
            except Exception:
                logger.exception("%s: releasing its memory failed", slot.name)

    def _reject_waiting(self, slot: _Slot, message: str, retry_after_s: float | None) -> None:
        """Give up on every request of ``slot`` (queued, or held by its instance)."""
        requests = list(slot.queued)
        slot.queued.clear()
        if slot.instance is not None:
            held = list(slot.instance.scheduler.requests.values())
            for request in held:
                slot.instance.scheduler.abort(request.request_id)
            requests += held
        for request in requests:
            self._rejections.append(Rejection(request.request_id, message, retry_after_s))

    def _time_out_waiting(self, slot: _Slot, now: float) -> None:
        """Reject requests that have waited longer than the load timeout for their model and
        have produced nothing yet (a preempted request resumes whenever its model wakes)."""
        limit = self.load_timeout_s
        waiting = list(slot.queued)
        if slot.instance is not None:
            waiting += [r for r in slot.instance.scheduler.waiting if not r.output_token_ids]
        expired = [r for r in waiting if now - r.arrival_time > limit]
        for request in expired:
            if request in slot.queued:
                slot.queued.remove(request)
            elif slot.instance is not None:
                slot.instance.scheduler.abort(request.request_id)
            message = (
                f"the model {slot.name} was not ready within {limit:.0f} s "
                f"(it is {slot.state.value}); retry later"
            )
            self._rejections.append(Rejection(request.request_id, message, retry_after_s=5.0))

    # -- sizes -----------------------------------------------------------------------------------

    def footprint(self, name: str) -> int:
        """The bytes ``name`` takes from the budget while loaded."""
        return self._footprint(self._slot(name))

    def _footprint(self, slot: _Slot) -> int:
        """What ``slot`` holds while loaded: weights, KV cache and reserve."""
        plan = slot.plan
        kv = slot.kv_cache_bytes if slot.kv_cache_bytes is not None else self._kv_cache_bytes(slot)
        weights = slot.instance.weight_bytes if slot.instance is not None else plan.weight_bytes
        return weights + kv + self._reserve(slot)

    def _reserve(self, slot: _Slot) -> int:
        measured = slot.instance.load_report.resident_bytes if slot.instance is not None else 0
        return max(slot.plan.reserve_bytes, measured)

    def _resident(self, slot: _Slot) -> int:
        """What a sleeping ``slot`` still holds: its graphs' pool and buffers, where its
        graphs survive the sleep."""
        if slot.instance is None or not self.arenas.keeps_addresses:
            return 0
        return slot.instance.load_report.resident_bytes

    def _kv_cache_bytes(self, slot: _Slot) -> int:
        plan, cache, policy = slot.plan, slot.plan.config.cache, slot.policy
        if cache.num_blocks is not None:
            return plan.kv_bytes_for(cache.num_blocks)
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        total = self.budget.total_bytes
        if total is None:
            return CPU_KV_BYTES_DEFAULT
        share = policy.memory_share or 1.0 / len(self.slots)
        wanted = int(total * share) - plan.weight_bytes - self._reserve(slot)
        return max(wanted, plan.kv_bytes_for(plan.min_kv_blocks))

    def _slot(self, name: str) -> _Slot:
        slot = self.slots.get(name)
        if slot is None:
            raise UnknownModelError(name)
        return slot
