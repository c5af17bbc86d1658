"""The host CPUs this process may run on: what its thread pools (kernel compiles, weight reads)
are sized by."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (a container's or `taskset`'s limit), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
