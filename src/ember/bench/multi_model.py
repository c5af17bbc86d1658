"""`ember bench multi-model`: one server holding several models in a memory budget that cannot
hold them all at once, measured three ways (--mode):

- ``traffic`` (the default): ShareGPT requests split across the models by --weight, at a total
  --concurrency, for --duration seconds (or --num-prompts requests). Per model: requests done,
  output tok/s, TTFT p50/p99, ITL p99, and the loads, sleeps and wakes the run caused; overall:
  output tok/s and the longest stall of a running stream (the largest gap between two streamed
  chunks of one request), of all and of those overlapping another model's load, wake, sleep or
  unload. A background task polls GET /v1/models every --poll-interval to see the transitions.
- ``wake``: sleep/wake and unload/load cycles of one loaded model (--target), timed by the
  server and by the client, against the host-to-device copy floor (bytes / seconds / floor).
- ``pair``: the first two models; all traffic to the first alone, then split 50/50 over both
  at the same concurrency: both output tok/s and their ratio.

The server is launched from a TOML config this module writes (``ember serve --config FILE``),
or --url names one already running.

    ember bench multi-model --model a=/ckpt/a --model b=/ckpt/b --weight 60 --weight 40 \\
        --budget-bytes 60e9 --kv-cache-bytes 8e9 --duration 300 --out multi.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import numpy as np

from ember.bench.client import ENDPOINT_PATHS, OpenAIStreamClient, RequestResult, ServerTokenCounter
from ember.bench.datasets import (
    LocalTokenizer,
    SampledRequest,
    TokenCounter,
    add_dataset_arguments,
    sample_requests,
)
from ember.bench.launch import LaunchedServer, LaunchSpec, ServerStartError
from ember.bench.stats import latency_samples_s, latency_summary_ms

MODES = ("traffic", "wake", "pair")
PROBE_MAX_TOKENS = 4
# States in which a model is being moved onto the device, and the action that moves it.
IN_PROGRESS_STATES = {"loading": "load", "waking": "wake"}
# Counters of /v1/models that rise when an action finishes, and the action.
ACTION_COUNTERS = (("loads", "load"), ("sleeps", "sleep"), ("wakes", "wake"))
H2D_PROBE_BYTES = 1 << 30
# Actions that copy the weights host to device, the ones measured against the copy floor.
COPY_ACTIONS = ("wake", "load")
# A benchmark stream may last long under load; a load or wake can take minutes.
_LONG_TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)
_POLL_TIMEOUT = aiohttp.ClientTimeout(total=10)
_BYTE_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_BYTES_RE = re.compile(
    r"\s*([0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][+-]?[0-9]+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE
)


class BenchmarkError(RuntimeError):
    """The benchmark could not run (bad flags, a refused action, a failing probe request)."""


# ----------------------------------------------------------------------------- command line


def byte_count(text: str) -> int:
    """A byte count from the command line: 8000000000, 8_000_000_000, 8e9, 8G, 8GB or 7.5GiB
    (k/M/G/T decimal, Ki/Mi/Gi/Ti binary), so budgets read as they are thought of."""
    match = _BYTES_RE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}")
    number, unit = match.groups()
    value = float(number.replace("_", "")) * _BYTE_UNITS[(unit or "").lower()]
    if value < 0 or value != round(value):
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}")
    return round(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `ember bench multi-model` flags to `parser`."""
    parser.add_argument("--mode", choices=MODES, default="traffic", help="what to measure")
    server = parser.add_argument_group("server (launched from a TOML config unless --url)")
    server.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    server.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a model to serve (repeat); with --url, NAME alone (default: all it lists)",
    )
    server.add_argument(
        "--weight",
        action="append",
        type=float,
        default=[],
        help="traffic share of each --model, in their order (default: equal shares)",
    )
    server.add_argument(
        "--kv-cache-bytes",
        action="append",
        type=byte_count,
        default=[],
        help="KV cache of each --model in their order, or one value for all (e.g. 8e9, 8GiB)",
    )
    server.add_argument("--max-model-len", type=int, default=4096, help="each model's context")
    server.add_argument(
        "--pin", action="append", default=[], metavar="NAME", help="a model never put to sleep"
    )
    server.add_argument("--idle-timeout", type=float, metavar="SECONDS", help="sleep when idle")
    server.add_argument("--no-preload", action="store_true", help="load models on first use")
    server.add_argument("--budget-bytes", type=byte_count, help="memory_budget_bytes")
    server.add_argument("--gpu-memory-utilization", type=float)
    server.add_argument("--sleep-host-memory-bytes", type=byte_count)
    server.add_argument("--model-load-timeout", type=float, metavar="SECONDS")
    server.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (and to the server)")
    server.add_argument("--server-args", default="", help='more `ember serve` flags: "--flag v"')
    server.add_argument("--server-cpus", help="pin the launched server to these CPUs (taskset)")
    server.add_argument("--server-log", help="keep the launched server's output in this file")
    server.add_argument(
        "--server-startup-timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="for the server's health and its preloads",
    )

    add_dataset_arguments(parser)
    load = parser.add_argument_group("load (traffic, pair)")
    load.add_argument("--tokenizer", help="for prompt lengths (default: the first model's dir)")
    load.add_argument("--endpoint", choices=tuple(ENDPOINT_PATHS), default="completions")
    load.add_argument("--concurrency", type=int, default=200, help="requests in flight, total")
    load.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="send for this long, cycling through the --num-prompts sampled (default: send each "
        "once)",
    )
    load.add_argument("--poll-interval", type=float, default=0.05, metavar="SECONDS")

    wake = parser.add_argument_group("wake")
    wake.add_argument("--target", help="the model to cycle (default: the first --model)")
    wake.add_argument("--repeats", type=int, default=5, help="cycles of each kind")
    wake.add_argument(
        "--h2d-gbps",
        type=float,
        help="the host-to-device floor in GB/s (default: measured here when CUDA is available)",
    )
    parser.add_argument("--out", help="write the report here as JSON")


@dataclass(frozen=True)
class ModelSpec:
    """One model of the run: its served name, checkpoint (None when --url serves it already),
    traffic weight, KV cache bytes (None: the server's default) and whether it is pinned."""

    name: str
    source: str | None
    weight: float = 1.0
    kv_cache_bytes: int | None = None
    pinned: bool = False


def parse_model_arg(text: str, need_path: bool) -> tuple[str, str | None]:
    """(name, path) of a --model value, NAME=PATH (or NAME alone when no path is needed)."""
    name, sep, path = text.partition("=")
    name, path = name.strip(), path.strip()
    if not name or (sep and not path) or (need_path and not path):
        raise BenchmarkError(f"--model {text!r}: expected NAME=PATH")
    return name, path or None


def per_model_values(values: Sequence, count: int, flag: str) -> list:
    """One value per model: as given (one per model), one repeated for all, or None for all."""
    if not values:
        return [None] * count
    if len(values) == 1:
        return list(values) * count
    if len(values) != count:
        raise BenchmarkError(f"{flag}: give one value, or one per --model ({count})")
    return list(values)


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """The models the flags describe, in --model order (empty with --url and no --model)."""
    pairs = [parse_model_arg(text, need_path=args.url is None) for text in args.model]
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise BenchmarkError("--model: a name is given twice")
    if not pairs and args.url is None:
        raise BenchmarkError("give --model NAME=PATH for each model (or --url)")
    unknown = sorted(set(args.pin) - set(names))
    if unknown and pairs:
        raise BenchmarkError(f"--pin names no --model: {', '.join(unknown)}")
    if args.weight and len(args.weight) != len(pairs):
        raise BenchmarkError(f"--weight: give one per --model ({len(pairs)})")
    if any(w < 0 for w in args.weight) or (args.weight and sum(args.weight) <= 0):
        raise BenchmarkError("--weight: shares must be >= 0 and not all 0")
    weights = args.weight or [1.0] * len(pairs)
    kv = per_model_values(args.kv_cache_bytes, len(pairs), "--kv-cache-bytes")
    return [
        ModelSpec(name, path, weight, kv_bytes, name in args.pin)
        for (name, path), weight, kv_bytes in zip(pairs, weights, kv, strict=True)
    ]


def server_config(args: argparse.Namespace, specs: Sequence[ModelSpec]) -> dict:
    """The `ember serve --config` contents for the flags: engine-wide keys, then [[models]].
    Options left out are left out, so the server keeps its defaults."""
    top = {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "memory_budget_bytes": args.budget_bytes,
        "sleep_host_memory_bytes": args.sleep_host_memory_bytes,
        "model_load_timeout": args.model_load_timeout,
    }
    models = [
        _without_none(
            {
                "name": spec.name,
                "source": spec.source,
                "kv_cache_memory_bytes": spec.kv_cache_bytes,
                "max_model_len": args.max_model_len,
                "pinned": spec.pinned,
                "preload": not args.no_preload,
                "idle_timeout": args.idle_timeout,
            }
        )
        for spec in specs
    ]
    return {**_without_none(top), "models": models}


def _without_none(mapping: dict) -> dict:
    return {key: value for key, value in mapping.items() if value is not None}


def toml_value(value: bool | float | str) -> str:
    """`value` as a TOML literal (the few types a server config holds)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise ValueError("NaN in a server config")
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        # A JSON string without \u escapes of astral characters is a TOML basic string, once
        # DEL (which TOML, unlike JSON, must escape) is escaped too.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    raise TypeError(f"no TOML form for {type(value).__name__}")


def config_toml(config: dict) -> str:
    """TOML text of `config`: scalar keys first, then each list of tables as [[key]] blocks.
    (Python reads TOML but has no writer; a server config needs no more than this.)"""
    lines = [f"{key} = {toml_value(v)}" for key, v in config.items() if not isinstance(v, list)]
    for key, rows in config.items():
        if isinstance(rows, list):
            for row in rows:
                lines += ["", f"[[{key}]]"]
                lines += [f"{name} = {toml_value(v)}" for name, v in row.items()]
    return "\n".join(lines) + "\n"


def launch_spec(args: argparse.Namespace, config_path: Path) -> LaunchSpec:
    """How to start `ember serve --config config_path` with the --server-* flags."""
    server_args = ["--config", str(config_path)]
    if args.api_key:
        server_args += ["--api-key", args.api_key]
    return LaunchSpec(
        server_args=(*server_args, *shlex.split(args.server_args)),
        cpus=args.server_cpus,
        startup_timeout_s=args.server_startup_timeout,
        log_path=args.server_log,
    )


def redacted(command: Sequence[str], secret: str | None) -> str:
    """The command as a shell line, with the API key (the argument that is the key) hidden."""
    if not secret:
        return shlex.join(command)
    return shlex.join("***" if arg == secret else arg for arg in command)


# ----------------------------------------------------------------------------- request plan


@dataclass(frozen=True)
class LabeledRequest:
    """A sampled request and the model it goes to."""

    model: str
    request: SampledRequest


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split `total` into whole counts proportional to `weights` (largest remainder), so the
    counts add up to `total` and each is within one of its exact share."""
    if total < 0 or not weights or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError("apportion needs total >= 0 and weights >= 0, not all 0")
    quotas = [total * w / sum(weights) for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def split_requests(
    requests: Sequence[SampledRequest], weights: dict[str, float], seed: int
) -> list[LabeledRequest]:
    """Give each request a model: exactly the weights' shares of the requests (`apportion`), in
    an order shuffled with `seed`, so every model's requests spread over the whole run."""
    counts = apportion(len(requests), list(weights.values()))
    labels = [name for name, count in zip(weights, counts, strict=True) for _ in range(count)]
    random.Random(seed).shuffle(labels)
    return [LabeledRequest(label, request) for label, request in zip(labels, requests, strict=True)]


def token_counter(
    args: argparse.Namespace, specs: Sequence[ModelSpec], base_url: str, model: str
) -> TokenCounter:
    """Prompt lengths from --tokenizer, else the first model's checkpoint directory when it has
    a tokenizer.json (no server round trips, no API key needed), else the server's /tokenize."""
    if args.tokenizer:
        return LocalTokenizer(args.tokenizer)
    for spec in specs[:1]:
        if spec.source and (Path(spec.source) / "tokenizer.json").is_file():
            return LocalTokenizer(spec.source)
    return ServerTokenCounter(base_url, model)


def sample(args: argparse.Namespace, counter: TokenCounter) -> list[SampledRequest]:
    """The --dataset requests; an error if none passes the length filters."""
    try:
        requests = sample_requests(args, counter)
    except aiohttp.ClientError as exc:
        raise BenchmarkError(f"cannot count tokens through /tokenize ({exc}); pass --tokenizer")
    if not requests:
        raise BenchmarkError("the dataset gave no request that passes the length filters")
    if len(requests) < args.num_prompts:
        print(f"warning: only {len(requests)} requests pass the filters", file=sys.stderr)
    return requests


# ----------------------------------------------------------------------------- model states


@dataclass(frozen=True)
class ModelSnapshot:
    """One model's entry of GET /v1/models: its state and lifetime counters."""

    state: str
    loads: int = 0
    sleeps: int = 0
    wakes: int = 0
    weight_bytes: int = 0
    last_action: str | None = None
    last_seconds: float = 0.0


@dataclass(frozen=True)
class Poll:
    """What one GET /v1/models saw: the states held at some instant between sending the
    request and reading its answer (`time.perf_counter()` seconds)."""

    sent_s: float
    received_s: float
    models: dict[str, ModelSnapshot]


@dataclass(frozen=True)
class Transition:
    """A span (perf_counter seconds) that holds one load, wake, sleep or unload of a model."""

    model: str
    action: str
    start_s: float
    end_s: float


def parse_models(body: dict) -> dict[str, ModelSnapshot]:
    """Each model's snapshot from a GET /v1/models body, aliases (entries with a `parent`)
    left out so no model counts twice; a server without the `ember` fields reads as every
    model "loaded" with zero counters."""
    snapshots = {}
    for entry in body.get("data") or ():
        if entry.get("parent"):
            continue
        ember = entry.get("ember") or {}
        last = ember.get("last_transition") or {}
        snapshots[entry["id"]] = ModelSnapshot(
            state=ember.get("state", "loaded"),
            loads=int(ember.get("loads") or 0),
            sleeps=int(ember.get("sleeps") or 0),
            wakes=int(ember.get("wakes") or 0),
            weight_bytes=int(ember.get("weight_bytes") or 0),
            last_action=last.get("action"),
            last_seconds=float(last.get("seconds") or 0.0),
        )
    return snapshots


def transitions_from_polls(polls: Sequence[Poll]) -> list[Transition]:
    """Every transition the polls show, merged per model and action.

    A poll seeing "loading" or "waking" places one inside the span from the poll before it to
    the poll after it. A counter that rose between two polls (or a model gone "unloaded") places
    one that ended between them and began the server's reported seconds earlier. Sleeps and
    unloads have no in-progress state, so the counters are the only way to see those.
    """
    spans: list[Transition] = []
    for i, poll in enumerate(polls):
        before = polls[i - 1] if i else poll
        after = polls[i + 1] if i + 1 < len(polls) else poll
        for name, snapshot in poll.models.items():
            if snapshot.state in IN_PROGRESS_STATES:
                action = IN_PROGRESS_STATES[snapshot.state]
                spans.append(Transition(name, action, before.sent_s, after.received_s))
            if i and name in before.models:
                spans += finished_between(name, before.models[name], snapshot, before, poll)
    return merge_transitions(spans)


def finished_between(
    name: str, old: ModelSnapshot, new: ModelSnapshot, first: Poll, second: Poll
) -> list[Transition]:
    """Transitions that ended between two polls of a model (its counters rose, or it became
    unloaded): each spans from `seconds` (the server's last_transition when it is that action,
    else 0) before the first poll was sent to when the second poll's answer came."""
    actions = [
        action
        for counter, action in ACTION_COUNTERS
        if getattr(new, counter) > getattr(old, counter)
    ]
    if new.state == "unloaded" and old.state != "unloaded":
        actions.append("unload")
    return [
        Transition(
            name,
            action,
            first.sent_s - (new.last_seconds if new.last_action == action else 0.0),
            second.received_s,
        )
        for action in actions
    ]


def merge_transitions(spans: Iterable[Transition]) -> list[Transition]:
    """Overlapping spans of the same model and action merged into one, sorted by start."""
    merged: list[Transition] = []
    for span in sorted(spans, key=lambda t: (t.model, t.action, t.start_s)):
        last = merged[-1] if merged else None
        same = last is not None and (last.model, last.action) == (span.model, span.action)
        if same and span.start_s <= last.end_s:
            merged[-1] = Transition(
                span.model, span.action, last.start_s, max(last.end_s, span.end_s)
            )
            continue
        merged.append(span)
    return sorted(merged, key=lambda t: (t.start_s, t.model, t.action))


def counter_deltas(
    before: dict[str, ModelSnapshot], after: dict[str, ModelSnapshot]
) -> dict[str, dict[str, int]]:
    """Loads, sleeps and wakes of each model between two GET /v1/models."""
    return {
        name: {
            counter: getattr(snapshot, counter) - getattr(before.get(name, snapshot), counter)
            for counter, _ in ACTION_COUNTERS
        }
        for name, snapshot in after.items()
    }


# ----------------------------------------------------------------------------- stalls


@dataclass(frozen=True)
class Stall:
    """A gap between two consecutive streamed chunks of one request to `model`, and the other
    models' transitions it overlaps ((model, action) pairs)."""

    model: str
    start_s: float
    end_s: float
    overlapping: tuple[tuple[str, str], ...] = ()

    @property
    def seconds(self) -> float:
        """The gap's length."""
        return self.end_s - self.start_s

    def as_dict(self, origin_s: float) -> dict:
        """JSON form, times in seconds after `origin_s` (the run's start)."""
        return {
            "seconds": self.seconds,
            "model": self.model,
            "start_s": self.start_s - origin_s,
            "end_s": self.end_s - origin_s,
            "overlapping": [{"model": m, "action": a} for m, a in self.overlapping],
        }


def longest_stalls(
    streams: Iterable[tuple[str, Sequence[float]]], transitions: Sequence[Transition]
) -> tuple[Stall | None, Stall | None]:
    """(the longest gap of any stream, with every transition it overlaps, its own model's
    included; the longest gap that overlaps a transition of a model other than the stream's
    own, with those), None where there is none. `streams` are (model, chunk arrival times)
    pairs. A gap that overlaps only its own model's transition (a stream cannot
    run while its model sleeps) is no sign of one model disturbing another, so it is left out
    of the second figure."""
    overall: Stall | None = None
    during: Stall | None = None
    for model, times in streams:
        if len(times) < 2:
            continue
        t = np.asarray(times, dtype=np.float64)
        gaps = np.diff(t)
        i = int(gaps.argmax())
        if overall is None or gaps[i] > overall.seconds:
            start, end = float(t[i]), float(t[i + 1])
            overall = Stall(model, start, end, overlapping(start, end, transitions))
        candidate = _longest_overlapping(model, t, gaps, transitions)
        if candidate and (during is None or candidate.seconds > during.seconds):
            during = candidate
    return overall, during


def _longest_overlapping(
    model: str, t: np.ndarray, gaps: np.ndarray, transitions: Sequence[Transition]
) -> Stall | None:
    """The longest gap of one stream that overlaps another model's transition."""
    others = [
        tr for tr in transitions if tr.model != model and tr.start_s < t[-1] and tr.end_s > t[0]
    ]
    if not others:
        return None
    overlaps = np.zeros(len(gaps), dtype=bool)
    for tr in others:
        overlaps |= (t[:-1] < tr.end_s) & (t[1:] > tr.start_s)
    if not overlaps.any():
        return None
    i = int(np.where(overlaps, gaps, -1.0).argmax())
    start, end = float(t[i]), float(t[i + 1])
    return Stall(model, start, end, overlapping(start, end, others))


def overlapping(
    start_s: float, end_s: float, transitions: Iterable[Transition]
) -> tuple[tuple[str, str], ...]:
    """(model, action) of each transition that overlaps the span, sorted, without repeats."""
    return tuple(
        sorted(
            {(t.model, t.action) for t in transitions if t.start_s < end_s and t.end_s > start_s}
        )
    )


# ----------------------------------------------------------------------------- figures


def window_output_tokens(result: RequestResult, start_s: float, end_s: float) -> float:
    """Output tokens of a completed request delivered in [start_s, end_s], its tokens spread
    evenly over its chunks (as `stats.output_tokens_per_second` does)."""
    if not result.success or not result.chunk_times_s:
        return 0.0
    times = np.asarray(result.chunk_times_s)
    inside = np.count_nonzero((times >= start_s) & (times <= end_s))
    return result.output_tokens * inside / len(times)


def model_figures(results: Sequence[RequestResult], start_s: float, end_s: float) -> dict:
    """One model's figures over the window [start_s, end_s]: requests sent, done and failed,
    output tokens delivered in the window and their rate, and the latency summaries (TTFT,
    TPOT, ITL, E2EL in ms, over every request)."""
    window_s = end_s - start_s
    tokens = sum(window_output_tokens(r, start_s, end_s) for r in results)
    figures = {
        "requests": len(results),
        "completed": sum(r.success for r in results),
        "failed": sum(not r.success for r in results),
        "output_tokens": sum(r.output_tokens for r in results if r.success),
        "window_output_tokens": tokens,
        "output_throughput": tokens / window_s if window_s > 0 else None,
    }
    for name, samples in latency_samples_s(results).items():
        figures.update(latency_summary_ms(name, samples))
    return figures


def traffic_report(
    records: Sequence[tuple[str, RequestResult]],
    weights: dict[str, float],
    window: tuple[float, float],
    polls: Sequence[Poll],
    before: dict[str, ModelSnapshot],
    after: dict[str, ModelSnapshot],
) -> dict:
    """The traffic figures: per model (with the loads, sleeps and wakes between `before` and
    `after`), the totals, the transitions the polls saw and the longest stalls. Times in the
    report are seconds after the window's start."""
    start_s, end_s = window
    by_model: dict[str, list[RequestResult]] = {name: [] for name in weights}
    for name, result in records:
        by_model.setdefault(name, []).append(result)
    deltas = counter_deltas(before, after)
    total_weight = sum(weights.values())
    models = {
        name: {
            "weight": weights.get(name, 0.0) / total_weight,
            **model_figures(results, start_s, end_s),
            **deltas.get(name, dict.fromkeys(("loads", "sleeps", "wakes"), 0)),
        }
        for name, results in by_model.items()
    }
    transitions = transitions_from_polls(polls)
    overall, during = longest_stalls(
        ((name, result.chunk_times_s) for name, result in records), transitions
    )
    window_s = end_s - start_s
    total_tokens = sum(m["window_output_tokens"] for m in models.values())
    return {
        "window_s": window_s,
        "requests": len(records),
        "completed": sum(m["completed"] for m in models.values()),
        "failed": sum(m["failed"] for m in models.values()),
        "total_output_throughput": total_tokens / window_s if window_s > 0 else None,
        "models": models,
        "polls": len(polls),
        "transitions": [
            {**asdict(t), "start_s": t.start_s - start_s, "end_s": t.end_s - start_s}
            for t in transitions
        ],
        "longest_stall": overall.as_dict(start_s) if overall else None,
        "longest_stall_during_other_transition": during.as_dict(start_s) if during else None,
        "error_examples": sorted({r.error for _, r in records if not r.success})[:5],
    }


def h2d_fraction(nbytes: int, seconds: float | None, h2d_gbps: float | None) -> float | None:
    """bytes / (seconds x floor): the share of the host-to-device copy rate an action reached
    (None without a floor, a size or a time)."""
    if not h2d_gbps or not nbytes or not seconds or seconds <= 0:
        return None
    return nbytes / (seconds * h2d_gbps * 1e9)


@dataclass(frozen=True)
class ActionTiming:
    """One POST /v1/models/{name}/{action}: the server's seconds and the client's round trip."""

    action: str
    server_s: float
    client_s: float
    state: str


def action_summary(
    timings: Sequence[ActionTiming], weight_bytes: int, h2d_gbps: float | None
) -> dict:
    """Each run of one action and the medians, with the fraction of the copy floor reached in
    the server's seconds and in the round trip. Runs whose server seconds exceed the round trip
    (which holds them) are counted: such a server figure is wrong, the round trip is not."""
    runs = [
        {**asdict(t), "fraction_of_h2d": h2d_fraction(weight_bytes, t.server_s, h2d_gbps)}
        for t in timings
    ]
    median_server = statistics.median(t.server_s for t in timings) if timings else None
    median_client = statistics.median(t.client_s for t in timings) if timings else None
    return {
        "runs": runs,
        "median_server_s": median_server,
        "median_client_s": median_client,
        "median_fraction_of_h2d": h2d_fraction(weight_bytes, median_server, h2d_gbps),
        "median_client_fraction_of_h2d": h2d_fraction(weight_bytes, median_client, h2d_gbps),
        "server_s_over_round_trip": sum(t.server_s > t.client_s for t in timings),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


# ----------------------------------------------------------------------------- the server


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers every request carries: the bearer key when there is one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class ControlClient:
    """GET /v1/models and the POST /v1/models/{name}/{action} controls of one server."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str):
        self.session = session
        self.base_url = base_url.rstrip("/")

    async def poll(self) -> Poll:
        """One GET /v1/models, timed."""
        sent = time.perf_counter()
        async with self.session.get(self.base_url + "/v1/models", timeout=_POLL_TIMEOUT) as resp:
            resp.raise_for_status()
            body = await resp.json()
        return Poll(sent, time.perf_counter(), parse_models(body))

    async def models(self) -> dict[str, ModelSnapshot]:
        """Every model's snapshot now."""
        try:
            return (await self.poll()).models
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchmarkError(f"GET {self.base_url}/v1/models: {exc}") from exc

    async def act(self, name: str, action: str) -> ActionTiming:
        """POST the action and wait for it to be done; an error names the server's reason."""
        url = f"{self.base_url}/v1/models/{name}/{action}"
        start = time.perf_counter()
        try:
            async with self.session.post(url, timeout=_LONG_TIMEOUT) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchmarkError(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        client_s = time.perf_counter() - start
        if resp.status != 200:
            raise BenchmarkError(f"POST {url}: HTTP {resp.status}: {error_message(text)}")
        body = json.loads(text)
        return ActionTiming(action, float(body.get("seconds") or 0.0), client_s, body.get("state"))


def error_message(text: str) -> str:
    """The message of an OpenAI-style error body (the text itself if it is not one)."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]


async def wait_until_settled(control: ControlClient, timeout_s: float) -> dict:
    """Wait until no model is loading or waking (the server's preloads, say); the snapshots."""
    deadline = time.perf_counter() + timeout_s
    while True:
        models = await control.models()
        if not any(m.state in IN_PROGRESS_STATES for m in models.values()):
            return models
        if time.perf_counter() > deadline:
            busy = [n for n, m in models.items() if m.state in IN_PROGRESS_STATES]
            raise BenchmarkError(f"models still loading after {timeout_s:.0f} s: {busy}")
        await asyncio.sleep(0.5)


async def ensure_loaded(control: ControlClient, name: str, timeout_s: float) -> None:
    """Bring `name` to "loaded": wake it if asleep, load it if not on the device."""
    state = (await wait_until_settled(control, timeout_s))[name].state
    if state == "sleeping":
        await control.act(name, "wake")
    elif state in ("unloaded", "failed"):
        await control.act(name, "load")


async def poll_models(
    control: ControlClient, interval_s: float, polls: list[Poll], stop: asyncio.Event
) -> None:
    """Append a poll to `polls` every `interval_s` until `stop` is set; a failed poll (the
    server busy past the poll timeout) is skipped, not fatal."""
    while not stop.is_set():
        started = time.perf_counter()
        try:
            polls.append(await control.poll())
        except (aiohttp.ClientError, TimeoutError):
            pass
        wait_s = max(0.0, interval_s - (time.perf_counter() - started))
        try:
            await asyncio.wait_for(stop.wait(), timeout=wait_s)
        except TimeoutError:
            pass


@dataclass
class TrafficRun:
    """What the load generator saw: (model, result) of every request, and the window over
    which throughput counts (the duration, or until the last request ended)."""

    records: list[tuple[str, RequestResult]] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0


def _schedule(plan: Sequence[LabeledRequest], repeat: bool) -> Iterator[LabeledRequest]:
    """The plan once, or over and over when `repeat` (an empty plan yields nothing)."""
    while plan:
        yield from plan
        if not repeat:
            return


async def drive_traffic(
    clients: dict[str, OpenAIStreamClient],
    plan: Sequence[LabeledRequest],
    concurrency: int,
    duration_s: float | None,
) -> TrafficRun:
    """Keep `concurrency` requests in flight over all models, in plan order (cycled until
    `duration_s` passes, if given, then the ones in flight finish). The slots are shared, as
    one pool of clients would share them: requests waiting for their model to load hold theirs."""
    run = TrafficRun(start_s=time.perf_counter())
    deadline = run.start_s + duration_s if duration_s else None
    gate = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()

    async def send(item: LabeledRequest) -> None:
        try:
            run.records.append((item.model, await clients[item.model].send(item.request)))
        finally:
            gate.release()

    for item in _schedule(plan, repeat=deadline is not None):
        await gate.acquire()
        if deadline is not None and time.perf_counter() >= deadline:
            gate.release()
            break
        task = asyncio.create_task(send(item))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    run.end_s = deadline if deadline is not None else time.perf_counter()
    return run


@dataclass(frozen=True)
class Target:
    """Where and how to reach the server, and the settings shared by every phase."""

    base_url: str
    endpoint: str
    api_key: str | None
    concurrency: int
    duration_s: float | None
    poll_interval_s: float
    settle_timeout_s: float


async def traffic_phase(
    target: Target, plan: Sequence[LabeledRequest], weights: dict[str, float], probe: Sequence[str]
) -> dict:
    """One timed run of `plan`: settle, a short request to each of `probe` (it must work, and
    those models are then loaded), then the load with the poller beside it; its report."""
    connector = aiohttp.TCPConnector(limit=target.concurrency)
    headers = auth_headers(target.api_key)
    async with (
        aiohttp.ClientSession(headers=headers, timeout=_LONG_TIMEOUT) as control_session,
        aiohttp.ClientSession(
            headers=headers, connector=connector, timeout=_LONG_TIMEOUT
        ) as session,
    ):
        control = ControlClient(control_session, target.base_url)
        clients = {
            name: OpenAIStreamClient(session, target.base_url, name, target.endpoint)
            for name in weights
        }
        await wait_until_settled(control, target.settle_timeout_s)
        for name in probe:
            result = await clients[name].send(plan[0].request, max_tokens=PROBE_MAX_TOKENS)
            if not result.success:
                raise BenchmarkError(f"the probe request to {name} failed: {result.error}")
        before = await control.models()
        polls: list[Poll] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_models(control, target.poll_interval_s, polls, stop))
        try:
            run = await drive_traffic(clients, plan, target.concurrency, target.duration_s)
        finally:
            stop.set()
            await poller
        after = await control.models()
    return traffic_report(run.records, weights, (run.start_s, run.end_s), polls, before, after)


async def wake_cycles(target: Target, name: str, repeats: int, h2d_gbps: float | None) -> dict:
    """Sleep then wake `name` `repeats` times, then unload then load it as often; the timings
    against the copy floor (the weights of /v1/models moved in the server's seconds)."""
    async with aiohttp.ClientSession(
        headers=auth_headers(target.api_key), timeout=_LONG_TIMEOUT
    ) as session:
        control = ControlClient(session, target.base_url)
        models = await wait_until_settled(control, target.settle_timeout_s)
        if name not in models:
            raise BenchmarkError(f"{name!r} is not served; the server has {sorted(models)}")
        await ensure_loaded(control, name, target.settle_timeout_s)
        timings: dict[str, list[ActionTiming]] = {
            a: [] for a in ("sleep", "wake", "unload", "load")
        }
        for first, second in (("sleep", "wake"), ("unload", "load")):
            for _ in range(repeats):
                timings[first].append(await control.act(name, first))
                timings[second].append(await control.act(name, second))
        weight_bytes = (await control.models())[name].weight_bytes
    return {
        "model": name,
        "weight_bytes": weight_bytes,
        "h2d_gbps": h2d_gbps,
        **{
            action: action_summary(t, weight_bytes, h2d_gbps if action in COPY_ACTIONS else None)
            for action, t in timings.items()
        },
    }


async def served_names(base_url: str, api_key: str | None) -> list[str]:
    """The names GET /v1/models lists."""
    async with aiohttp.ClientSession(headers=auth_headers(api_key)) as session:
        return list(await ControlClient(session, base_url).models())


# ----------------------------------------------------------------------------- H2D floor


def measure_h2d_gbps(nbytes: int = H2D_PROBE_BYTES, repeats: int = 3) -> float | None:
    """Host-to-device copy rate in GB/s: a pinned host tensor of `nbytes` copied to the GPU,
    best of `repeats` after a warm-up; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def h2d_floor_gbps(given: float | None) -> tuple[float | None, str | None]:
    """(GB/s, where it came from): --h2d-gbps if given, else measured by `measure_h2d_gbps`
    in a child of this process, so that no CUDA context of the benchmark's own stays on the
    GPU beside the server's budget; (None, None) without CUDA."""
    if given:
        return given, "--h2d-gbps"
    code = "from ember.bench.multi_model import measure_h2d_gbps as m; print(m())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
        )
        answer = done.stdout.split()[-1]
        gbps = None if answer == "None" else float(answer)  # None: no CUDA here
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        print(f"warning: no H2D floor measured ({exc})", file=sys.stderr)
        return None, None
    return (gbps, "measured") if gbps else (None, None)


# ----------------------------------------------------------------------------- modes


async def run_mode(
    args: argparse.Namespace,
    target: Target,
    specs: Sequence[ModelSpec],
    requests: Sequence[SampledRequest],
    h2d: tuple[float | None, str | None],
) -> dict:
    """The figures of the chosen --mode against the server at `target`."""
    if args.mode == "wake":
        name = args.target or specs[0].name
        report = await wake_cycles(target, name, args.repeats, h2d[0])
        return {**report, "h2d_source": h2d[1]}
    if args.mode == "pair":
        first, second = specs[0].name, specs[1].name
        alone = {first: 1.0}
        split = {first: 1.0, second: 1.0}
        single = await traffic_phase(
            target, split_requests(requests, alone, args.seed), alone, [first]
        )
        both = await traffic_phase(
            target, split_requests(requests, split, args.seed), split, [first, second]
        )
        return pair_report(first, second, single, both)
    weights = {spec.name: spec.weight for spec in specs}
    heaviest = max(weights, key=weights.get)
    plan = split_requests(requests, weights, args.seed)
    return await traffic_phase(target, plan, weights, [heaviest])


def pair_report(first: str, second: str, single: dict, both: dict) -> dict:
    """Both phases of the pair mode and the ratio of their total output rates."""
    return {
        "models": [first, second],
        "single_output_throughput": single["total_output_throughput"],
        "split_output_throughput": both["total_output_throughput"],
        "split_over_single": ratio(
            both["total_output_throughput"], single["total_output_throughput"]
        ),
        "single": single,
        "split": both,
    }


async def resolve_specs(args: argparse.Namespace, specs: list[ModelSpec]) -> list[ModelSpec]:
    """With --url and no --model: every model the server lists, equal weights."""
    if specs:
        return specs
    return [ModelSpec(name, None) for name in await served_names(args.url, args.api_key)]


def check_mode(args: argparse.Namespace, specs: Sequence[ModelSpec]) -> None:
    """Refuse flag combinations the mode cannot run with."""
    if args.mode == "pair" and len(specs) < 2:
        raise BenchmarkError("--mode pair needs two models (the first two --model)")
    if not specs:
        raise BenchmarkError("the server lists no model")
    if args.concurrency < 1:
        raise BenchmarkError("--concurrency must be at least 1")


@contextmanager
def server_for(args: argparse.Namespace, specs: Sequence[ModelSpec]):
    """Yield (base URL, the launch command or None, the config written or None): --url as is,
    else a server started from a config in a temporary directory, stopped afterwards."""
    if args.url:
        yield args.url, None, None
        return
    config = server_config(args, specs)
    with tempfile.TemporaryDirectory(prefix="ember-multi-model-") as tmp:
        path = Path(tmp) / "server.toml"
        path.write_text(config_toml(config))
        with LaunchedServer(launch_spec(args, path)) as server:
            yield server.base_url, redacted(server.command, args.api_key), config


def measure(args: argparse.Namespace) -> dict:
    """Everything the run does: resolve the models, measure the copy floor (wake, before the
    server takes the GPU), start or reach the server, sample the requests, run the mode."""
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    specs = model_specs(args)
    if args.url:
        specs = asyncio.run(resolve_specs(args, specs))
    check_mode(args, specs)
    h2d = h2d_floor_gbps(args.h2d_gbps) if args.mode == "wake" else (None, None)
    with server_for(args, specs) as (base_url, command, config):
        target = Target(
            base_url,
            args.endpoint,
            args.api_key,
            args.concurrency,
            args.duration,
            args.poll_interval,
            args.server_startup_timeout,
        )
        requests: list[SampledRequest] = []
        if args.mode != "wake":
            requests = sample(args, token_counter(args, specs, base_url, specs[0].name))
        figures = asyncio.run(run_mode(args, target, specs, requests, h2d))
    return {
        "mode": args.mode,
        "base_url": base_url,
        "server_command": command,
        "server_config": config,
        "started_at": started_at,
        "concurrency": args.concurrency,
        "duration": args.duration,
        "num_prompts": len(requests),
        "dataset": args.dataset,
        "seed": args.seed,
        **figures,
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark `args` describe; print the summary, write the JSON; exit status."""
    try:
        report = measure(args)
    except (ServerStartError, BenchmarkError) as exc:
        print(f"ember bench multi-model: {exc}", file=sys.stderr)
        return 1
    print(format_summary(report))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report_ok(report) else 1


def report_ok(report: dict) -> bool:
    """Whether the run did its work: requests completed in every traffic phase (wake mode
    raises on any refused action)."""
    phases = [report.get("single"), report.get("split")] if report["mode"] == "pair" else [report]
    return report["mode"] == "wake" or all(p and p["completed"] for p in phases)


# ----------------------------------------------------------------------------- summary


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_traffic(report: dict, title: str) -> list[str]:
    """A table of the per-model figures, the total and the stalls."""
    header = (
        f"{'model':<16}{'share':>6}{'done':>8}{'fail':>6}{'out tok/s':>11}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'ITL p99':>9}{'loads':>7}{'sleeps':>7}{'wakes':>7}"
    )
    lines = [f"{' ' + title + ' ':-^97}", header]
    for name, m in report["models"].items():
        lines.append(
            f"{name[:15]:<16}{m['weight']:>6.0%}{m['completed']:>8}{m['failed']:>6}"
            f"{_num(m['output_throughput']):>11}{_num(m['median_ttft_ms']):>10}"
            f"{_num(m['p99_ttft_ms']):>10}{_num(m['p99_itl_ms']):>9}"
            f"{m['loads']:>7}{m['sleeps']:>7}{m['wakes']:>7}"
        )
    lines.append(
        f"total output: {_num(report['total_output_throughput'])} tok/s over "
        f"{report['window_s']:.1f} s; {report['completed']} done, {report['failed']} failed; "
        f"{len(report['transitions'])} transitions seen in {report['polls']} polls"
    )
    lines.append(f"longest stall: {_stall_text(report['longest_stall'])}")
    lines.append(
        "longest stall during another model's transition: "
        f"{_stall_text(report['longest_stall_during_other_transition'])}"
    )
    lines += [f"error: {e}" for e in report["error_examples"]]
    return lines


def _stall_text(stall: dict | None) -> str:
    if stall is None:
        return "-"
    text = f"{stall['seconds'] * 1e3:,.1f} ms ({stall['model']}, at {stall['start_s']:.2f} s)"
    during = ", ".join(f"{o['action']} of {o['model']}" for o in stall["overlapping"])
    return f"{text} during {during}" if during else text


def format_wake(report: dict) -> list[str]:
    """One line per action: server and client medians, the runs, the floor fraction."""
    floor = report["h2d_gbps"]
    lines = [
        (
            f"model {report['model']}: {report['weight_bytes'] / 1e9:.2f} GB of weights; "
            f"H2D floor {_num(floor, 2)} GB/s ({report['h2d_source'] or 'none'})"
        ),
        (
            f"{'action':<8}{'server s':>10}{'client s':>10}{'of floor':>10}{'(client)':>10}"
            "  server s of each run"
        ),
    ]
    for action in ("sleep", "wake", "unload", "load"):
        s = report[action]
        each = " ".join(f"{r['server_s']:.3f}" for r in s["runs"])
        lines.append(
            f"{action:<8}{_num(s['median_server_s'], 3):>10}{_num(s['median_client_s'], 3):>10}"
            f"{_percent(s['median_fraction_of_h2d']):>10}"
            f"{_percent(s['median_client_fraction_of_h2d']):>10}  {each}"
        )
        if s["server_s_over_round_trip"]:
            lines.append(
                f"  warning: the server's {action} seconds exceed the round trip in "
                f"{s['server_s_over_round_trip']} run(s): its figure is wrong"
            )
    return lines


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def format_summary(report: dict) -> str:
    """The report as a readable summary for stdout."""
    lines = [f"{' ember bench multi-model: ' + report['mode'] + ' ':=^97}"]
    if report["mode"] == "wake":
        lines += format_wake(report)
    elif report["mode"] == "pair":
        a, b = report["models"]
        lines += format_traffic(report["single"], f"all to {a}")
        lines += format_traffic(report["split"], f"50/50 over {a} and {b}")
        lines.append(
            f"output tok/s: {_num(report['single_output_throughput'])} alone, "
            f"{_num(report['split_output_throughput'])} split, "
            f"ratio {_num(report['split_over_single'], 3)}"
        )
    else:
        lines += format_traffic(report, f"concurrency {report['concurrency']}")
    lines.append("=" * 97)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m ember.bench.multi_model`."""
    parser = argparse.ArgumentParser(
        prog="ember bench multi-model", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
