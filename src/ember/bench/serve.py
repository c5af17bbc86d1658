"""`ember bench serve`: load an OpenAI-compatible server with sampled requests and report
throughput, latency and what the run cost in CPU and GPU.

    python -m ember.bench.serve --base-url http://127.0.0.1:8000 --num-prompts 1000 \\
        --max-concurrency 64 --output-json bench/results/serve.json
    python -m ember.bench.serve --launch MODEL --server-cpus 0 --num-prompts 16

With `--output-json PATH` the figures go to PATH and the plots to PATH with a .png suffix.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

from ember.bench.client import (
    ENDPOINT_PATHS,
    OpenAIStreamClient,
    RequestResult,
    ServerTokenCounter,
    fetch_model_ids,
)
from ember.bench.costs import CostMonitor
from ember.bench.datasets import (
    LocalTokenizer,
    SampledRequest,
    add_dataset_arguments,
    sample_requests,
)
from ember.bench.engine_steps import settled_step_counts, step_mix
from ember.bench.launch import LaunchedServer, LaunchSpec, ServerStartError
from ember.bench.plots import save_benchmark_plot
from ember.bench.stats import (
    LATENCY_METRICS,
    full_load_output_throughput,
    latency_samples_s,
    output_tokens_per_second,
    summarize,
)

PROBE_MAX_TOKENS = 4


class BenchmarkError(RuntimeError):
    """The benchmark could not run (no requests, the server refuses the probe request, ...)."""


@dataclass(frozen=True)
class ServerTarget:
    """Where to send requests; the client itself needs a session, made inside the event loop."""

    base_url: str
    model: str
    endpoint: str


@dataclass(frozen=True)
class LoadRun:
    """The raw outcome of sending the requests: per-request results and the wall time."""

    results: list[RequestResult]
    start_s: float
    duration_s: float


def add_server_target_arguments(
    parser: argparse.ArgumentParser,
    server_log_help: str = "keep the launched server's output in this file",
) -> argparse._ArgumentGroup:
    """The flags that name the server under test, one of --base-url and --launch (with
    `launch_spec`'s --server-* flags), and --model; the group, for a bench's own additions."""
    target = parser.add_argument_group("server under test (one of --base-url, --launch)")
    target.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--launch",
        nargs="?",
        const="",
        metavar="MODEL",
        help="start `ember serve [MODEL]` on a free port, run, then stop it",
    )
    target.add_argument(
        "--server-args", default="", help='extra `ember serve` flags: --server-args="--flag value"'
    )
    target.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        help="the launched server's: dummy makes random weights from the model's config.json",
    )
    target.add_argument("--server-cpus", help="pin the launched server to these CPUs (taskset -c)")
    target.add_argument("--server-startup-timeout", type=float, default=600.0, metavar="SECONDS")
    target.add_argument("--server-log", help=server_log_help)
    target.add_argument("--server-pid", type=int, help="with --base-url: sample this CPU tree")
    target.add_argument("--model", help="model name in requests (default: first of /v1/models)")
    return target


def add_serve_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `ember bench serve` flags to `parser`."""
    target = add_server_target_arguments(parser)
    target.add_argument("--endpoint", choices=tuple(ENDPOINT_PATHS), default="completions")

    add_dataset_arguments(parser)
    parser.add_argument(
        "--tokenizer", help="tokenizer.json or HF model dir for prompt lengths (default: /tokenize)"
    )

    load = parser.add_argument_group("load")
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf)"
    )

    report = parser.add_argument_group("report")
    report.add_argument("--output-json", help="write figures here and plots beside it (.png)")
    report.add_argument("--gpu-index", type=int, default=0, help="NVML index of the GPU to watch")
    report.add_argument("--sample-interval", type=float, default=0.5, metavar="SECONDS")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run_serve_bench(args: argparse.Namespace) -> int:
    """Run the benchmark `args` describe; print the summary, write the files; exit status."""
    if (args.base_url is None) == (args.launch is None):
        print("ember bench serve: give exactly one of --base-url and --launch", file=sys.stderr)
        return 2
    try:
        if args.launch is None:
            report, latencies_ms = measure(args, args.base_url, args.server_pid, None)
        else:
            with LaunchedServer(launch_spec(args)) as server:
                command = shlex.join(server.command)
                report, latencies_ms = measure(args, server.base_url, server.pid, command)
    except (ServerStartError, BenchmarkError) as exc:
        print(f"ember bench serve: {exc}", file=sys.stderr)
        return 1
    print(format_summary(report))
    if args.output_json:
        write_outputs(report, latencies_ms, Path(args.output_json))
    return 0 if report["completed"] else 1


def launch_spec(args: argparse.Namespace) -> LaunchSpec:
    """The `LaunchSpec` that the --launch/--server-* flags describe."""
    load_format = getattr(args, "load_format", None)
    return LaunchSpec(
        model=args.launch or None,
        server_args=(
            *shlex.split(args.server_args),
            *(("--load-format", load_format) if load_format else ()),
        ),
        cpus=args.server_cpus,
        startup_timeout_s=args.server_startup_timeout,
        log_path=args.server_log,
    )


def measure(
    args: argparse.Namespace, base_url: str, server_pid: int | None, server_command: str | None
) -> tuple[dict, dict[str, list[float]]]:
    """Sample the requests, send them while watching costs; return the flat report and every
    latency sample in ms (for the plots; too many to keep in the JSON)."""
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    model = args.model or first_served_model(base_url)
    counter = (
        LocalTokenizer(args.tokenizer) if args.tokenizer else ServerTokenCounter(base_url, model)
    )
    requests = sample_requests(args, counter)
    if not requests:
        raise BenchmarkError("the dataset gave no request that passes the length filters")
    if len(requests) < args.num_prompts:
        print(f"warning: only {len(requests)} requests pass the filters", file=sys.stderr)

    monitor = CostMonitor(server_pid, args.gpu_index, args.sample_interval)
    counts_before: list[dict | None] = []

    async def before_timed_load() -> None:  # after the probe: its steps are not the run's
        counts_before.append(await asyncio.to_thread(settled_step_counts, base_url, model))

    run = asyncio.run(
        drive_load(
            ServerTarget(base_url, model, args.endpoint),
            requests,
            args.max_concurrency,
            args.request_rate,
            args.seed,
            monitor,
            show_progress=not args.disable_tqdm,
            before_timed_load=before_timed_load,
        )
    )
    mix = step_mix(counts_before[0], settled_step_counts(base_url, model))
    figures = summarize(run.results, run.duration_s)
    report = {
        "model": model,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "seed": args.seed,
        "tokenizer": getattr(counter, "path", "server /tokenize"),
        **figures,
        **monitor.report(figures["total_output_tokens"]).as_dict(),
        **mix,
        **full_load_output_throughput(run.results, args.max_concurrency, args.request_rate),
        "server_command": server_command,
        "started_at": started_at,
        "output_throughput_per_s": output_tokens_per_second(run.results, run.start_s),
        "error_examples": sorted({r.error for r in run.results if not r.success})[:5],
    }
    return report, _latencies_ms(run.results)


async def drive_load(
    target: ServerTarget,
    requests: Sequence[SampledRequest],
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    monitor: CostMonitor,
    show_progress: bool = True,
    before_timed_load: Callable[[], Awaitable[None]] | None = None,
) -> LoadRun:
    """Send every request (Poisson arrivals at `request_rate`, at most `max_concurrency` in
    flight) after one short probe request; costs are sampled over the timed part only.
    ``before_timed_load`` runs between the probe and the timed part."""
    # aiohttp caps a session at 100 connections by default, which would cap the concurrency.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector) as session:
        client = OpenAIStreamClient(session, target.base_url, target.model, target.endpoint)
        probe = await client.send(requests[0], max_tokens=PROBE_MAX_TOKENS)
        if not probe.success:
            raise BenchmarkError(f"the probe request failed: {probe.error}")
        if before_timed_load is not None:
            await before_timed_load()

        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        with tqdm(total=len(requests), disable=not show_progress, unit="req") as bar, monitor:
            start_s = time.perf_counter()
            tasks = [
                asyncio.create_task(_send_gated(client, request, gate, bar))
                async for request in _arrivals(requests, request_rate, seed)
            ]
            results = list(await asyncio.gather(*tasks))
            duration_s = time.perf_counter() - start_s
    return LoadRun(results, start_s, duration_s)


async def _arrivals(
    requests: Sequence[SampledRequest], request_rate: float, seed: int
) -> AsyncIterator[SampledRequest]:
    """Yield the requests at Poisson arrival times (all at once for an infinite rate)."""
    rng = np.random.default_rng(seed)
    for request in requests:
        yield request
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.exponential(1.0 / request_rate))


async def _send_gated(
    client: OpenAIStreamClient,
    request: SampledRequest,
    gate: asyncio.Semaphore | None,
    bar: tqdm,
) -> RequestResult:
    if gate is None:
        result = await client.send(request)
    else:
        async with gate:
            result = await client.send(request)
    bar.update(1)
    return result


def first_served_model(base_url: str) -> str:
    try:
        models = asyncio.run(fetch_model_ids(base_url))
    except aiohttp.ClientError as exc:
        raise BenchmarkError(f"cannot list models at {base_url}/v1/models: {exc}") from exc
    if not models:
        raise BenchmarkError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]


def _latencies_ms(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    return {
        name: [round(s * 1000.0, 3) for s in samples]
        for name, samples in latency_samples_s(results).items()
    }


def format_summary(report: dict) -> str:
    """A readable summary of the report, one figure per line."""

    def line(label: str, value, unit: str = "") -> str:
        shown = "-" if value is None else f"{value:,.2f}" if isinstance(value, float) else value
        return f"{label:<40}{shown} {unit}".rstrip()

    lines = [
        f"{' ember bench serve ':=^60}",
        line("Model", report["model"]),
        line("Requests completed / failed", f"{report['completed']} / {report['failed']}"),
        line("Duration", report["duration_s"], "s"),
        line(
            "Total input / output tokens",
            f"{report['total_input_tokens']:,} / {report['total_output_tokens']:,}",
        ),
        line("Request throughput", report["request_throughput"], "req/s"),
        line("Output token throughput", report["output_throughput"], "tok/s"),
        line(
            "  at full concurrency",
            report.get("full_load_output_throughput"),
            f"tok/s ({report['full_load_window_s']:.1f} s)"
            if report.get("full_load_window_s")
            else "",
        ),
        line("Total token throughput", report["total_token_throughput"], "tok/s"),
    ]
    for metric in LATENCY_METRICS:
        lines.append(f"{' ' + metric.upper() + ' (ms) ':-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(
                line(f"{stat.capitalize()} {metric.upper()}", report[f"{stat}_{metric}_ms"])
            )
    lines += [
        f"{' costs ':-^60}",
        line("Server CPU", report["server_cpu_seconds"], "CPU-s"),
        line("Server cores busy (mean)", report["server_cores_busy"]),
        line(
            "Server CPU-s per 1k output tokens", report["server_cpu_seconds_per_1k_output_tokens"]
        ),
        line(
            "GPU utilisation mean / max",
            _pair(report["gpu_util_mean"], report["gpu_util_max"]),
            "%",
        ),
        line("GPU memory used (max)", report["gpu_mem_used_max_mib"], "MiB"),
    ]
    if report.get("steps_with_prefill") is not None:
        steps = report["steps_decode_only"] + report["steps_with_prefill"]
        lines += [
            f"{' engine steps (server /metrics) ':-^60}",
            line("Steps / with a prompt chunk", f"{steps:,} / {report['steps_with_prefill']:,}"),
            line("Decodes per step (mean)", report["mean_decodes_per_step"]),
            line(
                "Prompt tokens per chunk step (mean)",
                report["mean_prefill_tokens_per_prefill_step"],
            ),
        ]
        if report.get("engine_gc_gen2_passes") is not None:
            pause_ms = report["engine_gc_pause_s"] * 1e3
            passes = report["engine_gc_gen2_passes"]
            lines.append(
                line("Engine GC: gen-2 passes / all pauses", f"{passes} / {pause_ms:,.1f} ms")
            )
    lines.append("=" * 60)
    return "\n".join(lines)


def _pair(first: float | None, second: float | None) -> str:
    if first is None or second is None:
        return "-"
    return f"{first:.1f} / {second:.1f}"


def write_outputs(report: dict, latencies_ms: dict[str, list[float]], json_path: Path) -> None:
    """Write the report as JSON at `json_path` and its plots at the same stem with .png."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    save_benchmark_plot(
        json_path.with_suffix(".png"),
        latencies_ms,
        report["output_throughput_per_s"],
        title=f"ember bench serve: {report['model']}, {report['completed']} requests, "
        f"concurrency {report['max_concurrency'] or 'unbounded'}",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m ember.bench.serve`."""
    parser = argparse.ArgumentParser(prog="ember bench serve", description=__doc__.split("\n")[0])
    add_serve_bench_arguments(parser)
    return run_serve_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
