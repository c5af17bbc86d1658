"""The peer for `ember bench serve`: the same sampled requests through Hugging Face transformers'
own continuous batching (paged attention over SDPA), in process, with the same figures.

    python -m ember.bench.peer_transformers --model DIR --num-prompts 1000 --seed 0 \\
        --output-json bench/results/peer_transformers.json

Requests are sampled by `ember.bench.datasets` with the tokenizer in DIR (or --tokenizer), so the
same seed and tokenizer give the same requests as `ember bench serve --tokenizer DIR`. Each one is
greedy, asks for exactly its sampled output length (its own `max_new_tokens`, EOS disabled with
`eos_token_id=-1`), and at most --max-concurrency are in the manager at once, refilled as they
finish, like the serving client's semaphore. There is no HTTP: this measures the engine alone,
so its CPU-seconds are a lower bound for a server built on it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from ember.bench.client import RequestResult
from ember.bench.costs import CostMonitor
from ember.bench.datasets import LocalTokenizer, SampledRequest, add_dataset_arguments
from ember.bench.datasets import sample_requests as sample_dataset
from ember.bench.stats import full_load_output_throughput, output_tokens_per_second, summarize

NO_EOS = -1  # transformers' request state ignores negative EOS ids: generation runs to the limit
SWITCH_CHOICES = ("auto", "on", "off")
_SWITCH_VALUES = {"auto": None, "on": True, "off": False}


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the transformers peer."""
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--tokenizer", help="tokenizer.json or dir (default: --model)")
    add_dataset_arguments(parser)
    parser.add_argument("--max-concurrency", type=int, help="requests in the manager at most")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1, cpu, ...")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--attn-implementation", default="paged|sdpa")
    parser.add_argument("--max-batch-tokens", type=int, help="tokens per step (default: auto)")
    parser.add_argument("--num-blocks", type=int, help="KV cache blocks (default: auto)")
    parser.add_argument("--block-size", type=int, help="tokens per KV block (default: 256)")
    parser.add_argument(
        "--cuda-graphs",
        choices=SWITCH_CHOICES,
        default="auto",
        help="auto: transformers' choice (off whenever the attention needs a mask, as sdpa does)",
    )
    parser.add_argument(
        "--async-batching", choices=SWITCH_CHOICES, default="auto", help="auto: transformers'"
    )
    parser.add_argument("--compile-level", type=int, default=0, help="torch.compile level 0-3")
    parser.add_argument(
        "--max-memory-percent",
        type=float,
        help="share of free GPU memory for the KV cache (default: transformers' 0.9); lower it "
        "to leave room for CUDA graph capture",
    )
    parser.add_argument("--output-json", help="write the figures here")
    parser.add_argument("--gpu-index", type=int, default=0, help="NVML index of the GPU to watch")
    parser.add_argument("--disable-tqdm", action="store_true")


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    """The model from --model on --device, with the paged attention continuous batching needs."""
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation=args.attn_implementation
    )
    return model.to(args.device).eval()


def batching_config(args: argparse.Namespace) -> ContinuousBatchingConfig:
    """Continuous batching sizes: transformers' automatic choice unless a flag overrides it."""
    overrides = {
        "max_batch_tokens": args.max_batch_tokens,
        "num_blocks": args.num_blocks,
        "block_size": args.block_size,
        "use_cuda_graph": _SWITCH_VALUES[args.cuda_graphs],
        "use_async_batching": _SWITCH_VALUES[args.async_batching],
        "default_compile_level": args.compile_level or None,
        "max_memory_percent": args.max_memory_percent,
    }
    return ContinuousBatchingConfig(**{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class PeerRun:
    """Per-request results in request order, the timed window, and the batching settings that
    transformers resolved (automatic sizes filled in)."""

    results: list[RequestResult]
    start_s: float
    duration_s: float
    batching: dict
    interrupted: bool = False  # stopped (SIGINT) before every request finished


def run_requests(
    model: torch.nn.Module,
    prompt_ids: Sequence[list[int]],
    output_lens: Sequence[int],
    cb_config: ContinuousBatchingConfig,
    max_concurrency: int | None,
    monitor: CostMonitor,
    show_progress: bool,
) -> PeerRun:
    """Generate every request through one continuous batching manager, warmed up (CUDA graphs
    captured) before the clock and the cost sampling start."""
    generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=max(output_lens), eos_token_id=NO_EOS
    )
    hints = WorkloadHints(max(map(len, prompt_ids)), max(output_lens), len(prompt_ids))
    pending = deque(range(len(prompt_ids)))
    limit = max_concurrency or len(prompt_ids)
    results: dict[str, RequestResult] = {}
    with model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        workload_hints=hints,
    ) as manager:
        batching = _resolved_batching(manager.continuous_batching_config)
        interrupted = False
        with tqdm(total=len(prompt_ids), disable=not show_progress, unit="req") as bar, monitor:
            start_s = time.perf_counter()
            try:
                _drive(manager, prompt_ids, output_lens, pending, limit, results, bar)
            except KeyboardInterrupt:  # a time limit (SIGINT): report what finished
                interrupted = True
            duration_s = time.perf_counter() - start_s
    unfinished = RequestResult(False, 0, start_s, error="not finished when the run was stopped")
    ordered = [results.get(f"req_{i}", unfinished) for i in range(len(prompt_ids))]
    return PeerRun(ordered, start_s, duration_s, batching, interrupted)


def _drive(manager, prompt_ids, output_lens, pending, limit, results, bar) -> None:
    """Keep `limit` requests in flight until every request has finished."""
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < limit:
            index = pending.popleft()
            manager.add_request(
                prompt_ids[index],
                request_id=f"req_{index}",
                max_new_tokens=output_lens[index],
                eos_token_id=NO_EOS,
                record_timestamps=True,
            )
            in_flight += 1
        output = manager.get_result(timeout=1.0)
        if output is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped unexpectedly")
            continue
        if output.is_finished():
            results[output.request_id] = to_request_result(output)
            in_flight -= 1
            bar.update(1)


def _resolved_batching(config: ContinuousBatchingConfig) -> dict:
    names = (
        "block_size",
        "num_blocks",
        "max_batch_tokens",
        "max_requests_per_batch",
        "use_cuda_graph",
        "use_async_batching",
        "default_compile_level",
        "allow_block_sharing",
    )
    return {name: getattr(config, name, None) for name in names}


def to_request_result(output) -> RequestResult:
    """A transformers `GenerationOutput` (with token timestamps) as a serving `RequestResult`,
    timed from when the request was added, as the serving client times from when it sends."""
    times = list(output.timestamps or [])
    result = RequestResult(
        success=output.error is None and bool(output.generated_tokens),
        prompt_len=len(output.prompt_ids),
        start_s=output.created_time,
        output_tokens=len(output.generated_tokens),
        chunk_times_s=times,
        error=output.error or "",
    )
    if result.success and times:
        result.ttft_s = times[0] - output.created_time
        result.e2el_s = times[-1] - output.created_time
        result.itl_s = [later - earlier for earlier, later in itertools.pairwise(times)]
    return result


def run_peer(args: argparse.Namespace) -> dict:
    """Sample, load, generate and measure; the report uses `ember bench serve`'s field names."""
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    tokenizer = LocalTokenizer(args.tokenizer or args.model)
    requests: list[SampledRequest] = sample_dataset(args, tokenizer)
    prompt_ids = tokenizer.encode([r.prompt for r in requests])
    model = load_model(args)
    gpu_index = args.gpu_index if str(args.device).startswith("cuda") else None
    monitor = CostMonitor(pid=os.getpid(), gpu_index=gpu_index)
    run = run_requests(
        model,
        prompt_ids,
        [r.output_len for r in requests],
        batching_config(args),
        args.max_concurrency,
        monitor,
        show_progress=not args.disable_tqdm,
    )
    figures = summarize(run.results, run.duration_s)
    return {
        "engine": f"transformers {transformers.__version__} continuous batching",
        "model": args.model,
        "attn_implementation": args.attn_implementation,
        "device": args.device,
        "dtype": args.dtype,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "max_concurrency": args.max_concurrency,
        "request_rate": "inf",  # all requests are offered at once, bounded by max_concurrency
        "seed": args.seed,
        "tokenizer": tokenizer.path,
        "batching": run.batching,
        "interrupted": run.interrupted,
        **figures,
        **monitor.report(figures["total_output_tokens"]).as_dict(),
        **full_load_output_throughput(run.results, args.max_concurrency),
        "started_at": started_at,
        "output_throughput_per_s": output_tokens_per_second(run.results, run.start_s),
    }


def format_summary(report: dict) -> str:
    """The headline figures, one per line."""
    keys = (
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "mean_tpot_ms",
        "server_cpu_seconds_per_1k_output_tokens",
        "gpu_util_mean",
    )
    lines = [f"{' transformers peer ':=^60}", f"{'engine':<42}{report['engine']}"]
    for key in keys:
        value = report[key]
        shown = "-" if value is None else f"{value:,.2f}" if isinstance(value, float) else value
        lines.append(f"{key:<42}{shown}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m ember.bench.peer_transformers`."""
    parser = argparse.ArgumentParser(
        prog="python -m ember.bench.peer_transformers", description=__doc__.split("\n")[0]
    )
    add_peer_arguments(parser)
    args = parser.parse_args(argv)
    report = run_peer(args)
    print(format_summary(report))
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
