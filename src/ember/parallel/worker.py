"""A tensor-parallel worker process: one rank's shard of a model, run step by step as rank 0
sends them (`ember.parallel.workers` starts it).

It plans the model as rank 0 did, joins the ranks' process group, builds its share with the
calls `ModelInstance` makes (`ember.engine.model_parts`: its ops, attention, parameters, KV
cache, and its slices of the checkpoint), says ``ready``, then runs each `ShardStep` it
receives until it receives None. It exits when rank 0's process does (its pipe closes, or the
parent's sentinel fires while it waits in a collective), and reports any error over the pipe
before it exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import traceback

from ember.parallel.workers import WorkerSpec


def worker_main(spec: WorkerSpec, conn) -> None:
    """The spawned process's target."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when the ranks stop
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(message)s"
    )
    _exit_with_parent()
    try:
        runner = _join_and_build(spec, conn)
        while (step := pickle.loads(conn.recv_bytes())) is not None:
            runner.run(step)
    except (EOFError, BrokenPipeError):
        return  # rank 0 is gone
    except BaseException as exc:
        logging.getLogger(__name__).exception("tensor-parallel rank %d failed", spec.rank)
        try:
            conn.send(("failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except OSError:
            pass
        raise SystemExit(1) from exc


def _join_and_build(spec: WorkerSpec, conn):
    """Plan, join the group, build and load this rank's shard; returns its `ShardRunner`."""
    import datetime

    import torch.distributed as dist

    from ember.engine.device_arena import ArenaFactory
    from ember.engine.model_parts import (
        allocate_kv_cache,
        allocate_model,
        build_attention,
        cos_sin_cache,
        load_weights,
    )
    from ember.engine.model_plan import plan_model
    from ember.kernels import kernel_cache
    from ember.kernels.tuning import KernelTuning
    from ember.layers.ops import select_ops
    from ember.parallel.group import COLLECTIVE_TIMEOUT_S, TorchParallelGroup
    from ember.parallel.shard_step import ShardRunner
    from ember.runner.input_buffers import InputBuffers

    config = spec.config
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, is_master=False, timeout=timeout)
    plan = plan_model(config)
    conn.send(("joining",))
    group = TorchParallelGroup(store, spec.rank, spec.size, plan.device)
    if plan.device.type == "cuda":
        kernel_cache.prepare(plan.device, plan.checkpoint, config.kernel_cache_dir)
    tuning = KernelTuning.for_device(
        plan.device, config.kernel_tuning, config.fp8_widen_in_registers
    )
    ops = select_ops(
        plan.device, config.backend, config.programmatic_launch, config.defer_norms, tuning
    )
    attention = build_attention(plan, ops, tuning)
    arenas = ArenaFactory(plan.device)
    model, _ = allocate_model(plan, ops, attention, group, arenas, zeroed=False)
    kv_cache, _ = allocate_kv_cache(plan, spec.num_blocks, arenas)
    bytes_read = load_weights(model, plan, None)
    local = plan.local_layers
    buffers = InputBuffers(
        plan.limits, config.cache.block_size, plan.device, attention, local=bool(local)
    )
    conn.send(("ready", bytes_read))
    return ShardRunner(model, attention, kv_cache, cos_sin_cache(plan), buffers, local)


def _exit_with_parent() -> None:
    """Exit as soon as the process holding rank 0 is gone, even inside a collective that would
    otherwise wait for its timeout."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
