"""Where the host's time goes in the engine loop: schedule, launch, wait for the GPU, collect,
update.

`TimedLoop` steps a model instance as `ModelInstance.step` does, through the same public calls
(`Scheduler.schedule`, `ModelRunner.launch` and `collect`, `Scheduler.update`), and times each.
With overlap the GPU runs step N while the host collects step N-1 and launches N+1. If the
host's busy time per step (all but the wait) reaches the GPU's step time, the GPU idles at each
step's start and the wait shrinks to nothing: the split tells host-bound from GPU-bound.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.engine.model_instance import ModelInstance
    from ember.engine.scheduler import Scheduler
    from ember.engine.step_types import RequestUpdate, SchedulerOutput
    from ember.runner.model_runner import ModelRunner, StepHandle

PHASES = ("schedule", "launch", "wait", "collect", "update")


class TimedLoop:
    """The engine loop over one scheduler and runner, with the seconds of each phase summed in
    `seconds` (`reset` clears them). A benchmark steps an instance through one loop only: the
    step in flight under overlap is the loop's, as it is the instance's in `ModelInstance.step`."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap: bool) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None

    @classmethod
    def of(cls, instance: ModelInstance, runner: ModelRunner | None = None) -> TimedLoop:
        """The loop of ``instance`` (on ``runner`` in place of its own, when given)."""
        return cls(instance.scheduler, runner or instance.runner, instance.overlap)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestUpdate]:
        """Advance by one step; returns what changed for each request (`ModelInstance.step`)."""
        clock, seconds = time.perf_counter, self.seconds
        start = clock()
        scheduled = self.scheduler.schedule()
        scheduled_at = clock()
        handle = self.runner.launch(scheduled)
        seconds["schedule"] += scheduled_at - start
        seconds["launch"] += clock() - scheduled_at
        if not self.overlap:
            return self._finish(scheduled, handle)
        # The next step is launched; now the previous one is collected.
        updates: list[RequestUpdate] = []
        if self._in_flight is not None:
            updates = self._finish(*self._in_flight)
        self._in_flight = None if scheduled.is_empty else (scheduled, handle)
        return updates

    def _finish(self, scheduled: SchedulerOutput, handle: StepHandle) -> list[RequestUpdate]:
        """Wait for a launched step's samples (timed apart from the rest of `collect`), collect
        them and fold them into the scheduler."""
        clock, seconds = time.perf_counter, self.seconds
        if handle.result is None and handle.done is not None:
            start = clock()
            handle.done.synchronize()
            seconds["wait"] += clock() - start
        start = clock()
        result = self.runner.collect(handle)
        collected = clock()
        updates = self.scheduler.update(scheduled, result)
        seconds["collect"] += collected - start
        seconds["update"] += clock() - collected
        return updates
