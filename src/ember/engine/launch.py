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
    """The spawned process's target: import the engine there, then run it. The disk starts
    on the weights of the models loaded at start before the imports (seconds) begin."""
    import time

    started = time.time()
    from ember.weights.prefetch import local_weight_files, prefetch

    prefetch(
        path
        for config in configs
        if config.policy.preload and not config.dummy_weights
        for path in local_weight_files(config.model)
    )
    from ember.engine.engine_core import run_engine

    timeline = {"engine_process_started": started, "engine_imported": time.time()}
    run_engine(configs, addresses, memory, load_timeout_s, timeline)
