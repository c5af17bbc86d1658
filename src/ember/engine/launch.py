"""Spawning the engine process from the front end.

Kept apart from `engine_core` on purpose: the front end only tokenizes and serves HTTP, so it
must not import the engine (and with it torch, ~1.5 s and ~300 MB). The spawned process imports
`engine_core` itself, in `_engine_main`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.config import EngineConfig, MemoryConfig
    from ember.engine.ipc import IpcAddresses


def start_engine_process(
    configs: list[EngineConfig],
    addresses: IpcAddresses,
    memory: MemoryConfig,
    load_timeout_s: float,
) -> multiprocessing.process.BaseProcess:
    """Spawn the engine process (a fresh interpreter: no forked CUDA or event-loop state)."""
    context = multiprocessing.get_context("spawn")
    process = context.Process(
        target=_engine_main,
        args=(configs, addresses, memory, load_timeout_s),
        name="ember-engine",
        daemon=False,
    )
    process.start()
    return process


def _engine_main(
    configs: list[EngineConfig],
    addresses: IpcAddresses,
    memory: MemoryConfig,
    load_timeout_s: float,
) -> None:
    """The spawned process's target: import the engine there, then run it."""
    from ember.engine.engine_core import run_engine

    run_engine(configs, addresses, memory, load_timeout_s)
