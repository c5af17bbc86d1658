"""The runner's side of the scheduler's contract, without a model.

Like `ember.runner.model_runner.ModelRunner`, it forgets the requests the scheduler names, keeps a
fresh state for each request it is handed (a preempted one comes back as new), decides that a
sequence samples when it feeds every token known on the host plus the one still in flight, and
records each sample into its request when the step is collected, unless the request was
finished or handed over again meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.engine.request import Request, RequestStatus
from ember.engine.scheduler import Scheduler
from ember.engine.step_types import RunnerOutput, SchedulerOutput


@dataclass(eq=False)
class _State:
    request: Request
    in_flight: int = 0


Launched = list[tuple[str, _State]]


class FakeRunner:
    def __init__(self) -> None:
        self.states: dict[str, _State] = {}

    def launch(self, out: SchedulerOutput) -> Launched:
        """Apply the step's diffs; the (request id, state) of each sequence that samples."""
        for request_id in out.finished_request_ids:
            self.states.pop(request_id, None)
        for new in out.new_requests:
            self.states[new.request.request_id] = _State(new.request)
        sampled = []
        for request_id in out.num_scheduled_tokens:
            state = self.states[request_id]
            request = state.request
            known = len(request.prompt_token_ids) + len(request.output_token_ids)
            if request.num_computed_tokens == known + (state.in_flight > 0):
                state.in_flight += 1
                sampled.append((request_id, state))
        return sampled

    def collect(self, launched: Launched, tokens: list[int]) -> RunnerOutput:
        """Record ``tokens`` (one per sampled sequence) into the requests still current."""
        ids, kept = [], []
        for (request_id, state), token in zip(launched, tokens, strict=True):
            state.in_flight -= 1
            request = state.request
            if (
                self.states.get(request_id) is not state
                or request.status is not RequestStatus.RUNNING
            ):
                continue
            request.record_sample(token)
            ids.append(request_id)
            kept.append(token)
        return RunnerOutput(ids, kept)

    def step(self, scheduler: Scheduler, out: SchedulerOutput, token: int = 7):
        """Launch, collect with every sample ``token``, and update the scheduler."""
        launched = self.launch(out)
        return scheduler.update(out, self.collect(launched, [token] * len(launched)))
