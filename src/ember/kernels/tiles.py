"""Fitting a kernel's tile configuration into one SM's shared memory."""

from __future__ import annotations

from collections.abc import Callable

# Shared memory a program may use: the H100/H200 limit per block (227 KiB), less a margin.
SHARED_MEMORY_BUDGET = 224 * 1024


def shrink_to_fit(
    config: dict[str, int],
    estimate: Callable[[dict[str, int]], int],
    steps: list[tuple[str, int, bool]],
    budget: int = SHARED_MEMORY_BUDGET,
) -> dict[str, int]:
    """Shrink ``config`` until ``estimate(config) <= budget``.

    ``steps`` are tried in order, the first that applies each round: ``(key, floor, halve)``
    halves ``key`` (or, with ``halve`` False, takes one off it) while it is above ``floor``. A
    config no step can shrink further is returned as is.
    """
    config = dict(config)
    while estimate(config) > budget:
        for key, floor, halve in steps:
            if config[key] > floor:
                config[key] = config[key] // 2 if halve else config[key] - 1
                break
        else:
            break
    return config
