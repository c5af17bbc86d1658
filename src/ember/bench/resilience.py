"""`ember bench resilience`: what clients that hang up, and an engine that dies, leave behind.

Against one launched `ember serve`, four phases:

1. ``baseline``: the fixed workload (``--num-prompts`` at ``--max-concurrency``), its output
   throughput;
2. ``disconnects``: ``--disconnect-streams`` streams at the same concurrency, each one, with
   probability ``--disconnect-fraction``, dropped by the client after a random number of
   chunks; then, once the server is idle, the KV cache blocks still held (every model's
   ``ember:kv_cache_blocks_used``: anything but 0 is a leak);
3. ``again``: the fixed workload once more, its throughput as a fraction of the baseline's;
4. ``engine_kill``: the fixed workload, and ``--kill-after`` seconds in, the engine process
   killed (SIGKILL): the requests that failed, and the seconds until /health answers 200 again
   and until a request is served again.

Writes one JSON report. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

from ember.bench.client import (
    DROPPED,
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
from ember.bench.launch import LaunchedServer, LaunchSpec, ServerStartError
from ember.bench.serve import ServerTarget, drive_load
from ember.bench.stats import summarize

IDLE_WAIT_S = 60.0
POLL_S = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--launch", default="", metavar="MODEL", help="the model to serve")
    parser.add_argument("--server-args", default="", help="more `ember serve` flags")
    parser.add_argument("--server-startup-timeout", type=float, default=600.0)
    parser.add_argument("--server-log", help="keep the server's output in this file")
    add_dataset_arguments(parser)
    parser.add_argument("--tokenizer", help="tokenizer.json for prompt lengths (default: server)")
    parser.add_argument("--max-concurrency", type=int, default=200)
    parser.add_argument("--disconnect-streams", type=int, default=2000)
    parser.add_argument("--disconnect-fraction", type=float, default=0.5)
    parser.add_argument("--kill-after", type=float, default=5.0, metavar="SECONDS")
    parser.add_argument("--output-json", type=Path)


def run(args: argparse.Namespace) -> int:
    spec = LaunchSpec(
        model=args.launch or None,
        server_args=tuple(shlex.split(args.server_args)),
        startup_timeout_s=args.server_startup_timeout,
        log_path=args.server_log,
    )
    try:
        with LaunchedServer(spec) as server:
            report = asyncio.run(_phases(args, server))
            report["server_command"] = shlex.join(server.command)
    except ServerStartError as exc:
        print(f"ember bench resilience: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in report.items() if k != "server_command"}, indent=1))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


async def _phases(args: argparse.Namespace, server: LaunchedServer) -> dict[str, Any]:
    base_url = server.base_url
    model = (await fetch_model_ids(base_url))[0]
    counter = (
        LocalTokenizer(args.tokenizer) if args.tokenizer else ServerTokenCounter(base_url, model)
    )
    requests = await asyncio.to_thread(sample_requests, args, counter)
    target = ServerTarget(base_url, model, "completions")
    report: dict[str, Any] = {
        "model": model,
        "num_prompts": len(requests),
        "max_concurrency": args.max_concurrency,
    }
    report["baseline"] = await _workload(target, requests, args, server)
    report["disconnects"] = await _disconnects(target, requests, args)
    report["disconnects"]["kv_blocks_held_when_idle"] = await asyncio.to_thread(
        _kv_blocks_when_idle, base_url
    )
    report["again"] = await _workload(target, requests, args, server)
    before = report["baseline"]["output_throughput"]
    report["again"]["throughput_vs_baseline"] = (
        report["again"]["output_throughput"] / before if before else None
    )
    report["engine_kill"] = await _engine_kill(target, requests, args, server)
    return report


async def _workload(
    target: ServerTarget, requests: list[SampledRequest], args: argparse.Namespace, server
) -> dict[str, Any]:
    started = time.perf_counter()
    results = await _workload_results(target, requests, args, server)
    duration_s = time.perf_counter() - started
    figures = summarize(results, duration_s)
    return {
        "completed": figures["completed"],
        "failed": len(results) - figures["completed"],
        "output_throughput": figures["output_throughput"],
        "duration_s": duration_s,
    }


async def _disconnects(
    target: ServerTarget, requests: list[SampledRequest], args: argparse.Namespace
) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed + 1)
    gate = asyncio.Semaphore(args.max_concurrency)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        client = OpenAIStreamClient(session, target.base_url, target.model, target.endpoint)

        async def one(request: SampledRequest, drop_after: int | None) -> RequestResult:
            async with gate:
                return await client.send(request, drop_after_chunks=drop_after)

        plan = []
        for i in range(args.disconnect_streams):
            request = requests[i % len(requests)]
            drops = rng.random() < args.disconnect_fraction
            plan.append((request, int(rng.integers(1, request.output_len + 1)) if drops else None))
        started = time.perf_counter()
        results = await asyncio.gather(*(one(r, d) for r, d in plan))
    dropped = sum(r.error == DROPPED for r in results)
    return {
        "streams": len(results),
        "dropped_by_client": dropped,
        "completed": sum(r.success for r in results),
        "failed": len(results) - dropped - sum(r.success for r in results),
        "duration_s": time.perf_counter() - started,
    }


async def _engine_kill(
    target: ServerTarget, requests: list[SampledRequest], args: argparse.Namespace, server
) -> dict[str, Any]:
    load = asyncio.create_task(_workload_results(target, requests, args, server))
    await asyncio.sleep(args.kill_after)
    engine = _engine_process(server.pid)
    killed_at = time.monotonic()
    engine.send_signal(signal.SIGKILL)
    healthy_s = await asyncio.to_thread(_wait_healthy, target.base_url, killed_at)
    served_s = await _wait_served(target, killed_at)
    results = await load
    return {
        "killed_after_s": args.kill_after,
        "requests": len(results),
        "completed": sum(r.success for r in results),
        "failed": sum(not r.success for r in results),
        "seconds_to_healthy": healthy_s,
        "seconds_to_first_served_request": served_s,
        "error_examples": sorted({r.error for r in results if not r.success})[:3],
    }


async def _workload_results(target, requests, args, server) -> list[RequestResult]:
    run = await drive_load(
        target,
        requests,
        args.max_concurrency,
        math.inf,
        args.seed,
        CostMonitor(server.pid, 0, 0.5),
        show_progress=False,
    )
    return run.results


def _engine_process(server_pid: int) -> psutil.Process:
    """The engine: the server's child started by multiprocessing's spawn."""
    children = psutil.Process(server_pid).children()
    engines = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
    if len(engines) != 1:
        raise RuntimeError(f"expected one engine process under {server_pid}, found {engines}")
    return engines[0]


def _wait_healthy(base_url: str, since: float, limit_s: float = 600.0) -> float | None:
    """Seconds from ``since`` until /health answers 200 (after first answering otherwise)."""
    seen_unhealthy = False
    while time.monotonic() - since < limit_s:
        status = _status(base_url + "/health")
        if status != 200:
            seen_unhealthy = True
        elif seen_unhealthy:
            return time.monotonic() - since
        time.sleep(POLL_S)
    return None


async def _wait_served(target: ServerTarget, since: float, limit_s: float = 600.0) -> float | None:
    body = {"model": target.model, "prompt": "Hello", "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - since < limit_s:
            try:
                async with session.post(target.base_url + "/v1/completions", json=body) as reply:
                    if reply.status == 200:
                        return time.monotonic() - since
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(POLL_S)
    return None


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return None


def _kv_blocks_when_idle(base_url: str) -> float | None:
    """Every model's KV blocks held, once no request runs or waits (None: never idle)."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while time.monotonic() < deadline:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as reply:
            text = reply.read().decode()
        gauges: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                gauges[sample.name] = gauges.get(sample.name, 0.0) + sample.value
        busy = gauges.get("ember:num_requests_running", 0) + gauges.get(
            "ember:num_requests_waiting", 0
        )
        if busy == 0:
            time.sleep(1.0)  # the engine's stats come every ~0.5 s: let the last one land
            with urllib.request.urlopen(base_url + "/metrics", timeout=5) as reply:
                text = reply.read().decode()
            return sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "ember:kv_cache_blocks_used"
            )
        time.sleep(0.25)
    return None
