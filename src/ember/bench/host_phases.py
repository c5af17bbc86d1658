"""Where the host's time goes in the engine loop: schedule, launch, wait for the GPU, collect,
update.

`TimedLoop` is the engine's own loop (`ember.engine.step_loop.StepLoop`, what `ModelInstance.step`
runs) with each phase timed. With overlap the GPU runs step N while the host collects step N-1
and launches N+1. If the host's busy time per step (all but the wait) reaches the GPU's step
time, the GPU idles at each step's start and the wait shrinks to nothing: the split tells
host-bound from GPU-bound.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ember.engine.step_loop import StepLoop

if TYPE_CHECKING:
    from ember.engine.model_instance import ModelInstance
    from ember.engine.scheduler import Scheduler
    from ember.engine.step_types import RequestUpdate, SchedulerOutput
    from ember.runner.model_runner import ModelRunner, StepHandle

PHASES = ("schedule", "launch", "wait", "collect", "update")


class TimedLoop(StepLoop):
    """The engine loop with the seconds of each phase summed in `seconds` (`reset` clears them).
    A benchmark steps an instance through one loop only: under overlap the step in flight is
    the loop's, as it is the instance's own loop's in `ModelInstance.step`."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap: bool) -> None:
        super().__init__(scheduler, runner, overlap)
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @classmethod
    def of(cls, instance: ModelInstance, runner: ModelRunner | None = None) -> TimedLoop:
        """The loop of ``instance`` (on ``runner`` in place of its own, when given)."""
        return cls(instance.scheduler, runner or instance.runner, instance.overlap)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def _schedule(self) -> SchedulerOutput:
        start = time.perf_counter()
        scheduled = super()._schedule()
        self.seconds["schedule"] += time.perf_counter() - start
        return scheduled

    def _launch(self, scheduled: SchedulerOutput) -> StepHandle:
        start = time.perf_counter()
        handle = super()._launch(scheduled)
        self.seconds["launch"] += time.perf_counter() - start
        return handle

    def _finish(self, scheduled: SchedulerOutput, handle: StepHandle) -> list[RequestUpdate]:
        """The wait for the step's samples timed apart from the rest of `collect`."""
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
