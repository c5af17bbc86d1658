"""Optional packages a path needs, checked where the path is chosen so that a missing one is one
clear error naming what to install (never a traceback from deep inside a child process)."""

from __future__ import annotations

import importlib.util

TRITON_MISSING = (
    "the GPU path needs Triton, which is not installed: pip install 'ember[gpu]' "
    "(or serve on the CPU with --device cpu)"
)


class MissingDependencyError(ImportError):
    """A package the asked-for path needs is not installed; the message says how to get it."""


def require_triton() -> None:
    """Raise `MissingDependencyError` unless Triton can be imported (the GPU path's kernels)."""
    if importlib.util.find_spec("triton") is None:
        raise MissingDependencyError(TRITON_MISSING)
