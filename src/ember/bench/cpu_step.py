"""`ember bench cpu-step`: the host's cost of an engine step, with a model that costs nothing.

Per decode step the host schedules, stages every running request's inputs, and folds the sampled
tokens back in. On a GPU that work overlaps the previous step and must stay well under its GPU
time, or the GPU waits. This runs the engine's own Scheduler and ModelRunner on the CPU, through
the loop `ember bench step` times (`ember.bench.host_phases.TimedLoop`, with overlap), over a
stand-in model whose forward pass and logits are rows of zeros: each phase is the engine's code,
``launch`` with a forward pass and a greedy draw of next to nothing.
"""

from __future__ import annotations

import argparse
import json

import torch

from ember.bench.host_phases import TimedLoop
from ember.config import StepLimits
from ember.engine.gc_heap import GcPauses, freeze_startup_heap
from ember.engine.kv_cache_manager import KVCacheManager
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler
from ember.layers.attention import ReferenceAttention
from ember.layers.ops import reference_ops
from ember.runner.model_runner import ModelRunner
from ember.runner.sampler import Sampler
from ember.sampling_params import SamplingParams

BLOCK_SIZE = 16
# The stand-in model's vocabulary: its logits are zeros, so greedy draws token 0.
VOCAB = 2


class NullModel(torch.nn.Module):
    """A model's interface to the runner (`forward` over a step's tokens, `compute_logits` over
    the rows that sample), returning rows of zeros."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__()
        self.hidden = torch.zeros(max_tokens, 1)
        self.logits = torch.zeros(max_tokens, VOCAB)

    def forward(self, input_ids, ctx, cos_sin_cache, kv_cache) -> torch.Tensor:
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]


def null_model_loop(limits: StepLimits, num_blocks: int, prefix_caching: bool = True) -> TimedLoop:
    """A scheduler and a runner over `NullModel` on the CPU, in an overlapped loop; with prefix
    caching (the engine's default), each full block is keyed as it fills."""
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, prefix_caching)
    runner = ModelRunner(
        model=NullModel(limits.max_num_batched_tokens),
        attention=ReferenceAttention(),
        kv_cache=torch.zeros(1),
        cos_sin_cache=torch.zeros(1),
        block_size=BLOCK_SIZE,
        sampler=Sampler(reference_ops(), VOCAB, torch.device("cpu"), limits),
        stop_ids_until_min_tokens=(),
        limits=limits,
        use_cuda_graphs=False,
    )
    return TimedLoop(Scheduler(limits, kv), runner, overlap=True)


def measure(batch: int, context: int, steps: int = 200, prefix_caching: bool = True) -> dict:
    """Host ms per decode step of ``batch`` requests at ~``context`` tokens, by phase."""
    max_tokens = steps + 64
    limits = StepLimits(
        max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=context + max_tokens
    )
    num_blocks = batch * (context + max_tokens) // BLOCK_SIZE + 2
    loop = null_model_loop(limits, num_blocks, prefix_caching)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [
        Request(f"r{i}", list(range(1, context)), params, i, max_tokens) for i in range(batch)
    ]
    for request in requests:
        loop.scheduler.add_request(request)
    while not all(request.output_token_ids for request in requests):
        loop.step()  # the prefill
    loop.reset()
    with GcPauses() as gc_pauses:
        for _ in range(steps):
            loop.step()
    ms = {f"{phase}_ms": seconds / steps * 1e3 for phase, seconds in loop.seconds.items()}
    del ms["wait_ms"]  # a CPU step has no event to wait on
    return {
        "batch": batch,
        "context": context,
        **ms,
        "total_ms": sum(ms.values()),
        "prefix_caching": prefix_caching,
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
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="no block keys (the engine's --no-enable-prefix-caching)",
    )
    parser.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> int:
    frozen = freeze_startup_heap() if args.freeze_gc else 0
    rows = [
        {
            **measure(int(b), args.context, args.steps, args.prefix_caching),
            "gc_frozen_objects": frozen,
        }
        for b in args.batches.split(",")
    ]
    for row in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
