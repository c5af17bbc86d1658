"""One model's engine loop: schedule, launch, collect, update.

With overlap (on a GPU) step N+1 is scheduled and launched before step N is collected, so the
CPU prepares the next step while the GPU runs the last one. `ModelInstance.step` is this loop;
a benchmark that times its phases subclasses it (`ember.bench.host_phases.TimedLoop`), so the
two never drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.engine.scheduler import Scheduler
    from ember.engine.step_types import RequestUpdate, SchedulerOutput
    from ember.runner.model_runner import ModelRunner, StepHandle


class StepLoop:
    """Steps one scheduler and runner; ``overlap``: launch the next step before collecting the
    one in flight."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap: bool) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestUpdate]:
        """Advance by one step; returns what changed for each request."""
        scheduled = self._schedule()
        handle = self._launch(scheduled)
        if not self.overlap:
            return self._finish(scheduled, handle)
        # The next step is launched while the previous one still runs; now that one is collected.
        updates: list[RequestUpdate] = []
        if self._in_flight is not None:
            updates = self._finish(*self._in_flight)
        self._in_flight = None if scheduled.is_empty else (scheduled, handle)
        return updates

    def drain(self) -> list[RequestUpdate]:
        """Collect the step in flight, if any (before the model sleeps)."""
        if self._in_flight is None:
            return []
        in_flight, self._in_flight = self._in_flight, None
        return self._finish(*in_flight)

    def _schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def _launch(self, scheduled: SchedulerOutput) -> StepHandle:
        return self.runner.launch(scheduled)

    def _finish(self, scheduled: SchedulerOutput, handle: StepHandle) -> list[RequestUpdate]:
        """Wait for a launched step's samples, collect them and fold them into the scheduler."""
        return self.scheduler.update(scheduled, self.runner.collect(handle))
