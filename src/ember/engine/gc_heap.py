"""The Python garbage collector in a serving process: keep its oldest generation small.

Reference counting frees what a step allocates; the cyclic collector finds almost nothing in
these processes. Its generation-2 passes still stop the world and walk every tracked object,
and after start-up nearly all of those are the imports, the model's modules and the server's
routes: a pass over the imports alone takes ~230 ms on a 2-core VM. A pass stops the engine
loop, so the GPU idles, or stops every stream of the front end. Moving the start-up heap into
the permanent generation (`gc.freeze`) leaves those passes only what serving allocates later
(`ember bench cpu-step [--freeze-gc]`, a step A/B of `--no-gc-freeze`;
bench/results/README.md, "GC freeze"). The collector itself stays on.

`GcPauses` counts the passes and their pauses while a block runs (`ember bench step` reports
them per row), so a stalled measurement can be told apart from a slow kernel. Given a
threshold, it also logs each pass that paused longer, with what the pass found (objects
collected) and what the oldest generation holds by type: whether a pass was slow for walking a
grown heap or for freeing garbage, and which objects outlived their requests.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter, deque
from types import TracebackType
from typing import Self

logger = logging.getLogger(__name__)

# A pass this long stalls an 8B decode step at batch 256 (~12 ms on an H200) by more than
# the step: worth a line in the log and a census of what it walked.
SLOW_PASS_S = 0.02


def freeze_startup_heap() -> int:
    """Collect once, then move every object the collector tracks into the permanent generation.
    Call when start-up is done (models loaded, graphs captured). Returns how many objects are
    frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Collector passes and their pause times per generation while the ``with`` block runs."""

    def __init__(self, slow_pass_s: float | None = None) -> None:
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.max_pause_s = 0.0
        self.slow_pass_s = slow_pass_s  # log passes that pause longer (None: never)
        self.slow_passes: deque[dict] = deque(maxlen=16)  # the latest, for a report
        self._started_at: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        if self._started_at is None:  # the block began inside a pass
            return
        pause = time.perf_counter() - self._started_at
        self._started_at = None
        generation = info["generation"]
        self.collections[generation] += 1
        self.pause_s[generation] += pause
        self.max_pause_s = max(self.max_pause_s, pause)
        if self.slow_pass_s is not None and pause > self.slow_pass_s:
            self._report_slow_pass(pause, info)

    def _report_slow_pass(self, pause: float, info: dict) -> None:
        # Walking the oldest generation costs as much as a pass; only slow passes pay it.
        oldest = gc.get_objects(generation=2)
        record = {
            "generation": info["generation"],
            "pause_ms": round(pause * 1e3, 2),
            "collected": info["collected"],
            "uncollectable": info["uncollectable"],
            "oldest_generation_objects": len(oldest),
            "frozen_objects": gc.get_freeze_count(),
            "oldest_generation_top_types": Counter(
                type(obj).__name__ for obj in oldest
            ).most_common(8),
        }
        del oldest
        self.slow_passes.append(record)
        logger.warning("slow garbage-collector pass: %s", record)

    def __enter__(self) -> Self:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self, steps: int) -> dict:
        """Per-step figures over ``steps`` steps, and the oldest generation's passes."""
        return {
            "gc_ms_per_step": sum(self.pause_s) / max(steps, 1) * 1e3,
            "gen2_collections": self.collections[2],
            "gen2_pause_ms": self.pause_s[2] * 1e3,
            "max_pause_ms": self.max_pause_s * 1e3,
            "slow_passes": list(self.slow_passes),
        }
