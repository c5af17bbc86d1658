"""Tensor-parallel ranks as threads of the test process, joined over gloo: each rank's model
shard built and loaded with the engine's own calls, for tests of the sharded layers that need
no worker processes (`ember.parallel.workers` spawns those; tests/parallel/test_tensor_parallel
_engine.py runs them)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ember.config import engine_config
from ember.engine.device_arena import ArenaFactory
from ember.engine.model_parts import (
    allocate_kv_cache,
    allocate_model,
    build_attention,
    cos_sin_cache,
    load_weights,
)
from ember.engine.model_plan import plan_model
from ember.kernels.tuning import KernelTuning
from ember.layers.ops import Ops, reference_ops
from ember.parallel.group import ParallelGroup, TorchParallelGroup

CPU = torch.device("cpu")


def run_ranks(size: int, fn: Callable[[ParallelGroup], Any], timeout_s: float = 120.0) -> list:
    """``fn(group)`` on ``size`` threads, each one rank of a gloo group (a group of one at
    size 1); their results by rank. The first error any rank raised is raised here."""
    if size == 1:
        return [fn(ParallelGroup())]
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    results: list = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            own = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, size)
            group = TorchParallelGroup(own, rank, size, CPU, timeout_s=timeout_s)
            results[rank] = fn(group)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results


class RankShard:
    """One rank's shard of the model at ``path`` (float32, the reference ops), loaded."""

    def __init__(
        self, path: Path, group: ParallelGroup, ops: Ops | None = None, **options: Any
    ) -> None:
        """``ops``: the reference ops unless given (a deferred-norm or split-K form of them)."""
        config = engine_config(
            str(path),
            device="cpu",
            dtype="float32",
            max_model_len=256,
            tensor_parallel_size=group.size,
            **options,
        )
        self.plan = plan = plan_model(config)
        ops = ops or reference_ops()
        attention = build_attention(plan, ops, KernelTuning.for_device(CPU))
        arenas = ArenaFactory(CPU)
        self.model, _ = allocate_model(plan, ops, attention, group, arenas, zeroed=False)
        self.bytes_read = load_weights(self.model, plan, None)
        self.kv_cache, _ = allocate_kv_cache(plan, 64, arenas)
        self.cos_sin = cos_sin_cache(plan)

    def prefill_logits(self, ids: torch.Tensor, ctx) -> torch.Tensor | None:
        """Every position's logits (rank 0; None on the others)."""
        with torch.inference_mode():
            hidden = self.model(ids, ctx, self.cos_sin, self.kv_cache)
            return self.model.compute_logits(hidden)
