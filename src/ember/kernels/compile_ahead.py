"""Compile a model's Triton kernels on several threads before their first launch.

On a machine whose Triton cache is cold, start-up is mostly compiling, one kernel
specialisation after another as each first launch meets it. Most of a compile runs outside the
GIL (MLIR and LLVM passes, `ptxas` as a subprocess), so compiles on threads overlap; a cold
start's load report (an empty `TRITON_CACHE_DIR`) measures it
(bench/results/README.md, "Compile workers").

Every engine kernel launches through `launch`. Inside `compile_ahead`, `launch` runs nothing: it
hands the launch's arguments to Triton's ``warmup``, which derives the same specialisation a real
launch would (argument types, 16-byte alignment, constexprs, launch options) and, under Triton's
`AsyncCompileMode`, queues its compile on the pool. Identical specialisations are compiled once.
When the block exits, every compile has finished and sits in its kernel's cache, so the launches
that follow find it there. The caller runs its forward passes inside the block only for their
launches' arguments: their outputs are never written and must be thrown away.

A compiled kernel also needs a launcher: a small C module Triton builds with the host's C
compiler at the kernel's first launch (cached on disk by its source). Left there, those builds
run one after another in the first launches, so each compile thread builds its kernel's launcher
into Triton's cache right after compiling it. That is best effort: if it fails, the first launch
builds the launcher as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ember.host_cpus import usable_cpus

logger = logging.getLogger(__name__)

# Whether launches in this context only queue compiles. A context variable, as Triton keeps its
# own compile mode: it is set and reset by `compile_ahead` alone, never left set.
_COMPILE_ONLY: ContextVar[bool] = ContextVar("ember_compile_only", default=False)

# A cap on the default: each compile's Python front end holds the GIL, so threads past the
# cores only wait. 16, the H200 host's cores, is the most tried.
MAX_COMPILE_WORKERS = 16


def compiling_ahead() -> bool:
    """Whether `launch` only queues compiles here (inside `compile_ahead`)."""
    return _COMPILE_ONLY.get()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``; inside `compile_ahead`, queue its compile instead."""
    if compiling_ahead():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def kernels_interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``): nothing to
    compile then."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def default_compile_workers() -> int:
    """One compile thread per CPU this process may run on, up to MAX_COMPILE_WORKERS."""
    return max(1, min(usable_cpus(), MAX_COMPILE_WORKERS))


def build_launcher(kernel: Any) -> None:
    """Build a compiled kernel's launcher into Triton's cache (what its first launch would do:
    Triton's driver's launcher class, built from the kernel's source and metadata). Best effort:
    a failure is logged and left to the first launch."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception as exc:  # noqa: BLE001 - best effort: the first launch builds it anyway
        logger.warning(
            "building a kernel launcher ahead failed (%r); its first launch builds it", exc
        )


class _CompileThenBuildLauncher(Executor):
    """Runs each compile Triton submits on ``pool``, then builds the compiled kernel's launcher
    on the same thread."""

    def __init__(self, pool: Executor, prepare: Callable[[Any], None]) -> None:
        self._pool = pool
        self._prepare = prepare

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        def compile_and_prepare() -> Any:
            kernel = fn(*args, **kwargs)
            self._prepare(kernel)
            return kernel

        return self._pool.submit(compile_and_prepare)


@dataclass
class CompileCounts:
    """What a compile pass met: kernel specialisations compiled, and those found in Triton's
    cache (a warm start should compile none), with the seconds Triton spent on each kind
    (summed over the threads)."""

    compiled: int = 0
    from_cache: int = 0
    compile_seconds: float = 0.0
    cache_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, *, times: Any, cache_hit: bool, **_: Any) -> None:
        """Triton's compilation listener (``triton.knobs.compilation.listener``)."""
        seconds = times.total / 1e6 if times is not None else 0.0  # microseconds
        with self._lock:
            if cache_hit:
                self.from_cache += 1
                self.cache_seconds += seconds
            else:
                self.compiled += 1
                self.compile_seconds += seconds


def prime_cache_key() -> None:
    """Compute Triton's own part of every kernel's cache key once, here: it hashes Triton's
    sources and its 400 MB library on first use, unlocked, so compile threads that meet it
    together would each hash it again. Best effort (a private function of Triton's)."""
    try:
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception as exc:  # noqa: BLE001 - the compiles compute it themselves anyway
        logger.debug("priming Triton's cache key failed: %r", exc)


@contextmanager
def compile_ahead(workers: int, counts: CompileCounts | None = None) -> Iterator[None]:
    """Within the block, `launch` queues compiles on ``workers`` threads and runs no kernel; on
    exit all of them have finished, their launchers built (a failed compile raises here).
    ``counts``: filled with what the pass compiled and what it found cached."""
    import triton

    prime_cache_key()
    knobs = triton.knobs.compilation
    listener_before = knobs.listener
    if counts is not None:
        knobs.listener = counts.record
    try:
        with (
            ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool,
            triton.AsyncCompileMode(_CompileThenBuildLauncher(pool, build_launcher)),
        ):
            token = _COMPILE_ONLY.set(True)
            try:
                yield
            finally:
                _COMPILE_ONLY.reset(token)
    finally:
        knobs.listener = listener_before
