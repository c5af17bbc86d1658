"""`ember bench cpu-step`: the host-side cost of one engine step, with no model and no GPU.

Per decode step the CPU schedules, stages the inputs of every running request and folds the
sampled tokens back in. On a GPU that work overlaps the previous step; it must stay well under
the step's GPU time (about 5 ms at batch 1 and 10-25 ms at batch 64-256 for an 8B model), or
the GPU waits. This measures exactly that host work on the real Scheduler and ModelRunner code.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ember.config import SchedulerConfig
from ember.engine.gc_heap import GcPauses, freeze_startup_heap
from ember.engine.kv_cache_manager import KVCacheManager
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler
from ember.engine.step_types import RunnerOutput
from ember.runner.model_runner import ModelRunner
from ember.runner.sampler import Sampler
from ember.sampling_params import SamplingParams


def _runner_without_model(max_seqs: int, max_model_len: int) -> ModelRunner:
    """A ModelRunner whose staging code is real; the forward pass is never called."""
    kv = torch.zeros(1, 2, 2, 16, 1, 16)
    return ModelRunner(
        model=None,
        kv_cache=kv,
        cos_sin_cache=torch.zeros(1),
        block_size=16,
        sampler=Sampler(None, 1, kv.device),
        stop_ids_until_min_tokens=(),
        max_num_seqs=max_seqs,
        max_num_batched_tokens=8192,
        max_model_len=max_model_len,
        use_cuda_graphs=False,
    )


def measure(batch: int, context: int, steps: int = 200) -> dict:
    kv = KVCacheManager(num_blocks=batch * (context + steps + 64) // 16 + 2, block_size=16)
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192,
                             max_model_len=context + steps + 64)  # fmt: skip
    scheduler = Scheduler(config, kv)
    runner = _runner_without_model(batch, config.max_model_len)
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(batch):
        scheduler.add_request(Request(f"r{i}", list(range(1, context)), params, i, steps + 64))

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        runner._apply_diffs(out)
        plan = runner._stage_inputs(out, runner.input_block(out).next_staging())
        _ = [runner._sampling_row(s) for s in plan.sampling_states]
        t2 = time.perf_counter()
        for state in plan.sampling_states:
            state.token_ids.append(7)
            state.num_output_tokens += 1
        ids = [s.request_id for s in plan.sampling_states]
        scheduler.update(out, RunnerOutput(ids, [7] * len(ids)))
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    while any(len(r.output_token_ids) == 0 for r in scheduler.requests.values()):
        step()  # prefill
    totals = [0.0, 0.0, 0.0]
    with GcPauses() as gc_pauses:
        for _ in range(steps):
            for i, seconds in enumerate(step()):
                totals[i] += seconds
    schedule_ms, stage_ms, update_ms = (t / steps * 1e3 for t in totals)
    return {
        "batch": batch,
        "context": context,
        "schedule_ms": schedule_ms,
        "stage_inputs_ms": stage_ms,
        "update_ms": update_ms,
        "total_ms": schedule_ms + stage_ms + update_ms,
        # The collector's passes inside the timed steps (the phases above include them).
        "gc": gc_pauses.summary(steps),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--freeze-gc",
        action="store_true",
        help="freeze the heap first, as the engine process does once loaded",
    )
    parser.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> int:
    frozen = freeze_startup_heap() if args.freeze_gc else 0
    rows = [
        {**measure(int(b), args.context, args.steps), "gc_frozen_objects": frozen}
        for b in args.batches.split(",")
    ]
    for row in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
