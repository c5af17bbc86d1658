"""Where the host's time goes inside the engine loop: schedule, launch, wait for the GPU, update.

With overlap the GPU runs step N while the host folds in step N-1 and launches N+1. If the host's
busy time per step (everything but the wait) reaches the GPU's step time, the GPU idles at each
step's start, and the wait shrinks to nothing: this split tells host-bound from GPU-bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from ember.engine.model_instance import ModelInstance


def _timed(totals: dict[str, float], name: str, method):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def _timed_collect(totals: dict[str, float], collect):
    """The runner's collect, with its wait on the step's event timed apart from the rest."""

    def wrapper(handle):
        if handle.result is None and handle.done is not None:
            start = time.perf_counter()
            handle.done.synchronize()
            totals["wait"] += time.perf_counter() - start
        start = time.perf_counter()
        try:
            return collect(handle)
        finally:
            totals["collect"] += time.perf_counter() - start

    return wrapper


@contextmanager
def host_phases(inst: ModelInstance) -> Iterator[dict[str, float]]:
    """Seconds spent in each phase of ``inst.step()`` while the block runs, summed.

    The instance's methods are shadowed by timed wrappers for the duration and restored after.
    """
    totals = dict.fromkeys(("schedule", "launch", "wait", "collect", "update"), 0.0)
    scheduler, runner = inst.scheduler, inst.runner
    shadows = {
        (scheduler, "schedule"): _timed(totals, "schedule", scheduler.schedule),
        (scheduler, "update"): _timed(totals, "update", scheduler.update),
        (runner, "launch"): _timed(totals, "launch", runner.launch),
        (runner, "collect"): _timed_collect(totals, runner.collect),
    }
    for (owner, name), wrapper in shadows.items():
        setattr(owner, name, wrapper)
    try:
        yield totals
    finally:
        for owner, name in shadows:
            delattr(owner, name)  # the class's method shows through again


# Parts of `launch` timed apart by `launch_parts`; the rest of `launch` (the graph bucket, the
# upload's enqueue, the fed tokens' copy, bookkeeping) is its total less these.
LAUNCH_PARTS = ("stage_inputs", "graph_replay", "sample", "copy_to_host")


@contextmanager
def launch_parts(inst: ModelInstance) -> Iterator[dict[str, float]]:
    """Seconds spent in each of `LAUNCH_PARTS` inside the runner's ``launch`` while the block
    runs, summed: which part grew when ``launch`` did. ``graph_replay`` stays 0 without graphs.

    Like `host_phases`, the runner's methods (and its sampler) are shadowed for the duration."""
    totals = dict.fromkeys(LAUNCH_PARTS, 0.0)
    runner = inst.runner
    methods = [(runner, "_stage_inputs", "stage_inputs"), (runner, "_copy_to_host", "copy_to_host")]
    if runner.graphs is not None:
        methods.append((runner.graphs, "replay", "graph_replay"))
    for owner, name, part in methods:
        setattr(owner, name, _timed(totals, part, getattr(owner, name)))
    sampler = runner.sampler  # an attribute, not a method: put back as it was
    runner.sampler = _timed(totals, "sample", sampler)
    try:
        yield totals
    finally:
        runner.sampler = sampler
        for owner, name, _ in methods:
            delattr(owner, name)
