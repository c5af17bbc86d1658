"""The Python garbage collector in a serving process: keep its oldest generation small.

Reference counting frees what a step allocates; the cyclic collector finds almost nothing in
these processes. Its generation-2 passes still stop the world and walk every tracked object,
and after start-up nearly all of those are the imports, the model's modules and the server's
routes. With only the imports of the engine and the server loaded (~227k objects), one pass
took ~230 ms on the 2-core CI VM (bench/results/README.md, "Garbage-collection pauses"). A pass
stops the engine loop, so the GPU idles, or stops every stream of the front end. Moving the
start-up heap into the permanent generation (`gc.freeze`) leaves those passes only what serving
allocates later. The collector itself stays on.

`GcPauses` counts the passes and their pauses while a block runs (`ember bench step` reports
them per row), so a stalled measurement can be told apart from a slow kernel.
"""

from __future__ import annotations

import gc
import time
from types import TracebackType
from typing import Self


def freeze_startup_heap() -> int:
    """Collect once, then move every object the collector tracks into the permanent generation.
    Call when start-up is done (models loaded, graphs captured). Returns how many objects are
    frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Collector passes and their pause times per generation while the ``with`` block runs."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.max_pause_s = 0.0
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
        }
