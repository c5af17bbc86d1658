"""`ember bench startup`: from `ember serve` to the first token, phase by phase, beside the floors.

Each scenario starts a fresh `ember serve MODEL`, asks /health every few milliseconds and, once
healthy, asks for one token. The server's own log line (`STARTUP_TIMELINE_TAG`, written when
the engine is ready) gives the engine's moments: its process start, imports, CUDA init, the
models' planning, and each load's setup, weight transfer, kernel compile and graph capture (and
an object store's download). The scenarios:

- ``warm``: page cache and kernel cache warm;
- ``cold-kernels``: page cache warm, an empty kernel cache;
- ``cold-disk``: the weight files evicted from the page cache (``--drop-caches all``: the whole
  page cache, which needs root), kernel cache warm;
- ``store``: from ``--s3-url`` into an empty download directory, kernel cache warm; the objects
  are fetched into memory once just before (the floor again, and a store on the same machine
  then serves from its page cache, as a remote one would not read this machine's disk).

The floors, measured in the same run: ``import torch`` in a fresh interpreter, reading the
weight files from a cold page cache on several threads, host-to-device copies from pinned
memory, and (with ``--s3-url``) ranged GETs of the weight objects into memory. Writes JSON and a
PNG timeline.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ember.bench.launch import LaunchedServer, LaunchSpec, ServerStartError
from ember.engine.engine_core import STARTUP_TIMELINE_TAG
from ember.weights.prefetch import local_weight_files

SCENARIOS = ("cold-kernels", "warm", "cold-disk", "store")
READ_CHUNK_BYTES = 32 << 20
READ_THREADS = 8
H2D_BYTES = 2 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a local model directory or GGUF file")
    parser.add_argument("--s3-url", help="the same model in an object store (the store scenario)")
    parser.add_argument(
        "--upload",
        action="store_true",
        help="first put MODEL's files at --s3-url (its bucket must exist)",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"which to run, in order (default: {','.join(SCENARIOS)})",
    )
    parser.add_argument(
        "--drop-caches",
        choices=("files", "all"),
        default="files",
        help="cold-disk: evict the weight files only (default), or the whole page cache (root)",
    )
    parser.add_argument("--server-args", default="", help="more `ember serve` flags")
    parser.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        help="dummy: the server makes random weights from MODEL's config.json (no weight file "
        "is read: the floors and the cold-disk scenario then read none)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--output-json", type=Path, help="the report (a PNG timeline beside it)")
    parser.add_argument("--label", default="", help="said in the report and the plot's title")


def run(args: argparse.Namespace) -> int:
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown or ("store" in scenarios and not args.s3_url):
        print(
            f"ember bench startup: unknown scenarios {sorted(unknown)}"
            if unknown
            else "ember bench startup: the store scenario needs --s3-url",
            file=sys.stderr,
        )
        return 2
    weights = [] if args.load_format == "dummy" else local_weight_files(args.model)
    weight_bytes = sum(path.stat().st_size for path in weights)
    if args.upload and args.s3_url:
        seconds = upload(Path(args.model), args.s3_url)
        print(f"uploaded {args.model} to {args.s3_url} in {seconds:.1f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="ember-startup-") as scratch:
        work = Path(scratch)
        kernel_dir = work / "kernels"
        report: dict[str, Any] = {
            "benchmark": "startup",
            "model": args.model,
            "s3_url": args.s3_url,
            "label": args.label,
            "weight_bytes": weight_bytes,
            "server_args": args.server_args,
            "load_format": args.load_format or "auto",
            "floors": measure_floors(weights, args.s3_url),
            "scenarios": {},
        }
        for scenario in scenarios:
            report["scenarios"][scenario] = _run_scenario(scenario, args, weights, kernel_dir, work)
            print(format_scenario(scenario, report["scenarios"][scenario]), flush=True)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
        save_timeline_plot(args.output_json.with_suffix(".png"), report)
    return 0


def _run_scenario(
    scenario: str, args: argparse.Namespace, weights: list[Path], kernel_dir: Path, work: Path
) -> dict[str, Any]:
    model = args.model
    kernels = kernel_dir
    dropped = None
    flags = shlex.split(args.server_args)
    if args.load_format:
        flags += ["--load-format", args.load_format]
    if scenario == "cold-kernels":
        kernels = work / f"kernels-empty-{time.monotonic_ns()}"
        _read_files(weights)  # page cache warm
    elif scenario == "warm":
        _read_files(weights)
    elif scenario == "cold-disk":
        dropped = evict(weights, everything=args.drop_caches == "all")
    elif scenario == "store":
        model = args.s3_url
        flags += ["--download-dir", str(work / f"downloads-{time.monotonic_ns()}")]
        # A store stands for another machine: its objects are read once into memory first, so a
        # store on this machine does not read its disk beside the download's own cache writes.
        store_floor_s = _download_seconds(args.s3_url)
    flags += ["--kernel-cache-dir", str(kernels)]
    cached_kernels = _files_under(kernels)
    log_path = work / f"{scenario}.log"
    spec = LaunchSpec(
        model=model,
        server_args=tuple(flags),
        startup_timeout_s=args.startup_timeout,
        log_path=str(log_path),
        health_poll_s=0.02,
    )
    try:
        with LaunchedServer(spec) as server:
            first_token_at = _first_token(server.base_url)
            command = shlex.join(server.command)
            started = server.started_at
            moments = {
                "front_end_answered": server.first_answer_at - started,
                "healthy": server.healthy_at - started,
                "first_token": first_token_at - started,
            }
    except ServerStartError as exc:
        return {"error": str(exc)}
    timeline = read_timeline(log_path.read_text(errors="replace"))
    if scenario == "cold-kernels" and kernels.exists() and not kernel_dir.exists():
        # The next scenarios start with the kernels this one compiled.
        os.replace(kernels, kernel_dir)
    return {
        "command": command,
        **({"store_download_floor_s": store_floor_s} if scenario == "store" else {}),
        "kernel_cache": {"dir": str(kernels), "files_before": cached_kernels},
        "page_cache_dropped": dropped,
        "first_token_s": moments["first_token"],
        "moments_s": moments,
        "phases": phases_of(timeline, started),
        "timeline": timeline,
    }


def _files_under(directory: Path) -> int:
    """Files in a kernel cache directory (0 if it does not exist): says how warm a start was."""
    return sum(1 for path in directory.rglob("*") if path.is_file()) if directory.exists() else 0


def _first_token(base_url: str) -> float:
    """Ask for one token; the moment it came back (time.time())."""
    with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        base_url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        json.load(response)
    return time.time()


def read_timeline(log: str) -> dict[str, Any]:
    """The engine's start-up timeline from the server's log (empty if it never got there)."""
    for line in reversed(log.splitlines()):
        _, tag, payload = line.partition(STARTUP_TIMELINE_TAG)
        if tag:
            return json.loads(payload)
    return {}


def phases_of(timeline: dict[str, Any], started: float) -> list[tuple[str, float, float]]:
    """``(phase, start, end)`` in seconds from the command's start, for the report and plot."""
    phases: list[tuple[str, float, float]] = []

    def add(name: str, start: float | None, end: float | None) -> None:
        if start and end and end >= start:
            phases.append((name, start - started, end - started))

    add("process start + front end", started, timeline.get("engine_process_started"))
    add("engine imports", timeline.get("engine_process_started"), timeline.get("engine_imported"))
    add("CUDA init", timeline.get("cuda_init_started"), timeline.get("cuda_initialised"))
    add("plan (config, tokenizer)", timeline.get("engine_imported"), timeline.get("models_planned"))
    for name, download in (timeline.get("downloads") or {}).items():
        add(f"download {name}", download.get("started_at"), download.get("finished_at"))
    for name, load in (timeline.get("loads") or {}).items():
        begin = load["started_at"]
        transfer = begin + load["setup_seconds"]
        end = begin + load["seconds"]
        add(f"setup {name}", begin, transfer)
        add(f"weights {name}", transfer, transfer + load["weight_load_seconds"])
        add(f"compile {name}", transfer, transfer + load["kernel_compile_seconds"])
        add(f"graph capture {name}", end - load["graph_capture_seconds"], end)
    return phases


def format_scenario(name: str, result: dict[str, Any]) -> str:
    if "error" in result:
        return f"{name}: failed: {result['error'].splitlines()[0]}"
    lines = [f"{name}: first token {result['first_token_s']:.2f} s after the command"]
    lines += [
        f"  {phase:<34} {start:7.2f} -> {end:7.2f} s" for phase, start, end in result["phases"]
    ]
    cache = result.get("kernel_cache") or {}
    if cache:
        lines.append(f"  kernel cache {cache['dir']}: {cache['files_before']} files before start")
    for model, load in (result.get("timeline", {}).get("loads") or {}).items():
        if "kernels_compiled" in load:
            lines.append(
                f"  kernels of {model}: {load['kernels_compiled']} compiled "
                f"({load['triton_compile_seconds']:.1f} s in Triton), "
                f"{load['kernels_from_cache']} from the cache "
                f"({load['triton_cache_seconds']:.1f} s)"
            )
    return "\n".join(lines)


def upload(model_dir: Path, url: str) -> float:
    """Put every file of a model directory under ``url`` (multipart for large files)."""
    import obstore

    from ember.weights.object_store import ObjectUrl, open_store

    target = ObjectUrl.parse(url)
    store = open_store(target)
    started = time.perf_counter()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        name = path.relative_to(model_dir).as_posix()
        obstore.put(store, target.key(name), path, chunk_size=64 << 20)
    return time.perf_counter() - started


# -- floors -------------------------------------------------------------------------------------


def measure_floors(weights: list[Path], s3_url: str | None) -> dict[str, Any]:
    total = sum(path.stat().st_size for path in weights)
    floors: dict[str, Any] = {"import_torch_s": _import_torch_seconds()}
    evict(weights, everything=False)
    started = time.perf_counter()
    _read_files(weights)
    read_s = time.perf_counter() - started
    floors["disk_read_gb_per_s"] = total / read_s / 1e9 if read_s else None
    floors["disk_read_s"] = read_s
    floors["h2d_gb_per_s"] = _h2d_gb_per_s()
    if floors["h2d_gb_per_s"]:
        floors["h2d_s"] = total / (floors["h2d_gb_per_s"] * 1e9)
    if s3_url:
        download_s = _download_seconds(s3_url)
        floors["download_s"] = download_s
        floors["download_gb_per_s"] = total / download_s / 1e9 if download_s else None
    return floors


def _import_torch_seconds() -> float:
    """``import torch`` in a fresh interpreter (the second of two: the first warms the files)."""
    seconds = 0.0
    for _ in range(2):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        seconds = time.perf_counter() - started
    return seconds


def evict(paths: list[Path], everything: bool) -> str:
    """Drop ``paths`` (or, where allowed, the whole page cache) from memory; says which."""
    if everything:
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "all"
        except OSError as exc:  # not root, or a read-only /proc in a container
            print(f"cannot drop the whole page cache ({exc}); evicting the weight files")
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "files"


def _read_files(paths: list[Path]) -> None:
    """Read every byte on several threads, as the loader does (and into the page cache)."""
    jobs = [
        (path, offset)
        for path in paths
        for offset in range(0, path.stat().st_size, READ_CHUNK_BYTES)
    ]

    def read(job: tuple[Path, int]) -> None:
        path, offset = job
        with open(path, "rb", buffering=0) as file:
            file.seek(offset)
            file.read(READ_CHUNK_BYTES)

    with ThreadPoolExecutor(READ_THREADS) as pool:
        list(pool.map(read, jobs))


def _h2d_gb_per_s() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(H2D_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(H2D_BYTES, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(3):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * H2D_BYTES / (time.perf_counter() - started) / 1e9


def _download_seconds(url: str) -> float:
    """Parallel ranged GETs of the model's weight objects into memory (nothing written)."""
    import obstore

    from ember.weights.object_download import DEFAULT_CONNECTIONS, DEFAULT_RANGE_BYTES
    from ember.weights.object_store import ObjectUrl, open_store

    target = ObjectUrl.parse(url)
    store = open_store(target)
    objects = [
        meta
        for batch in obstore.list(store, prefix=target.key("") if target.prefix else None)
        for meta in batch
        if meta["path"].endswith((".safetensors", ".gguf"))
    ]
    ranges = [
        (meta["path"], start, min(start + DEFAULT_RANGE_BYTES, meta["size"]))
        for meta in objects
        for start in range(0, meta["size"], DEFAULT_RANGE_BYTES)
    ]

    def get(job: tuple[str, int, int]) -> int:
        path, start, end = job
        return len(obstore.get_range(store, path, start=start, end=end))

    started = time.perf_counter()
    with ThreadPoolExecutor(DEFAULT_CONNECTIONS) as pool:
        fetched = sum(pool.map(get, ranges))
    assert fetched == sum(meta["size"] for meta in objects)
    return time.perf_counter() - started


# -- plot ---------------------------------------------------------------------------------------


def save_timeline_plot(path: Path, report: dict[str, Any]) -> Path:
    """One row per scenario: its phases as bars from the command's start, the first token as
    a line."""
    from matplotlib.figure import Figure

    scenarios = {k: v for k, v in report["scenarios"].items() if "phases" in v}
    rows = [(name, phase) for name, result in scenarios.items() for phase in result["phases"]]
    fig = Figure(figsize=(13, 1.2 + 0.32 * max(1, len(rows))), layout="constrained")
    ax = fig.add_subplot()
    colors: dict[str, Any] = {}
    labels = []
    for row, (scenario, (phase, start, end)) in enumerate(rows):
        kind = phase.split(" ")[0]
        color = colors.setdefault(kind, f"C{len(colors) % 10}")
        ax.barh(row, end - start, left=start, color=color, height=0.7)
        labels.append(f"{scenario}: {phase}")
    for row, (scenario, _) in enumerate(rows):
        first_token = scenarios[scenario]["first_token_s"]
        ax.plot([first_token], [row], marker="|", color="black", markersize=12)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since `ember serve` started (| marks the first token)")
    floors = report["floors"]
    ax.set_title(
        f"ember bench startup {report['label']}: {report['weight_bytes'] / 1e9:.1f} GB of weights; "
        f"floors: import torch {floors['import_torch_s']:.1f} s, disk "
        f"{floors['disk_read_s']:.1f} s, H2D {floors.get('h2d_s') or 0:.2f} s"
        + (f", download {floors['download_s']:.1f} s" if floors.get("download_s") else "")
    )
    fig.savefig(path, dpi=100)
    return path
