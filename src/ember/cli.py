"""The `ember` command: `ember serve [[NAME=]SOURCE ...] [--config FILE] ...` and
`ember bench <benchmark> ...`.

Flags are named as vLLM's where vLLM has one, so `ember serve` can replace `vllm serve` in a
script. Heavy modules (torch, the server) are imported only by the subcommand that runs, so
`ember --help` is instant. Environment variables are read here and nowhere else.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from ember.config import (
    ENGINE_OPTIONS,
    MEMORY_OPTIONS,
    PDL_MODES,
    QUANTIZATION_CHOICES,
    MemoryConfig,
    engine_config,
    memory_config,
)
from ember.server.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MODEL_LOAD_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    RestartPolicy,
)
from ember.server.config_file import CUDA_GRAPH_MODES, ModelEntry
from ember.vllm_flags import SOURCE_FORMATS, add_vllm_arguments, check_vllm_flags, http_options

log = logging.getLogger("ember.cli")


class BenchCommand(NamedTuple):
    """A benchmark under `ember bench`: its module, the function adding its flags to a parser,
    and the function running it (returns an exit code)."""

    module: str
    add_arguments: str
    run: str
    help: str


# Add a benchmark by adding a line; its module is imported only when it is the one run.
BENCH_COMMANDS: dict[str, BenchCommand] = {
    "serve": BenchCommand(
        "ember.bench.serve",
        "add_serve_bench_arguments",
        "run_serve_bench",
        "load an OpenAI-compatible server and report throughput, latency and cost",
    ),
    "multi-turn": BenchCommand(
        "ember.bench.multi_turn",
        "add_arguments",
        "run",
        "ShareGPT conversations replayed turn by turn as chat sessions: TTFT of later turns, "
        "throughput and prefix-cache hit rate, with prefix caching on and off",
    ),
    "step": BenchCommand(
        "ember.bench.step_bench",
        "add_arguments",
        "run",
        "decode and prefill step times on a GPU against the measured roofline",
    ),
    "profile": BenchCommand(
        "ember.bench.step_profile",
        "add_arguments",
        "run",
        "torch.profiler over decode and mixed steps on a GPU: kernel time by category",
    ),
    "tune": BenchCommand(
        "ember.bench.tune",
        "add_arguments",
        "run",
        "the sweeps behind the GPU tables of ember.kernels.tuning: skinny GEMM vs cuBLAS, decode "
        "attention tiles x splits, split-K, stream-K (--sections)",
    ),
    "isa": BenchCommand(
        "ember.bench.isa",
        "add_arguments",
        "run",
        "the fused MoE's kernels compiled for an NVIDIA GPU on a machine without one: registers, "
        "and the instructions their K loops issue per weight value",
    ),
    "make-model": BenchCommand(
        "ember.bench.make_model",
        "add_arguments",
        "run",
        "write a random-weight checkpoint of a real model's shape (e.g. llama-3.1-8b)",
    ),
    "parity": BenchCommand(
        "ember.bench.parity",
        "add_arguments",
        "run",
        "greedy tokens of the Triton path against the reference path on one checkpoint",
    ),
    "cpu-step": BenchCommand(
        "ember.bench.cpu_step",
        "add_arguments",
        "run",
        "host cost of one engine step (schedule, launch, collect, update) on a stand-in model, "
        "no GPU",
    ),
    "startup": BenchCommand(
        "ember.bench.startup",
        "add_arguments",
        "run",
        "from `ember serve` to the first token, phase by phase, warm and cold, from disk or an "
        "object store, beside the floors (import torch, disk, H2D, download)",
    ),
    "resilience": BenchCommand(
        "ember.bench.resilience",
        "add_arguments",
        "run",
        "clients that hang up mid-stream (KV blocks left held, throughput after) and an engine "
        "killed under load (failed requests, seconds to serve again)",
    ),
    "structured-output": BenchCommand(
        "ember.bench.structured_output",
        "add_arguments",
        "run",
        "the cost per output token of a JSON-schema constraint against none, at batch 1 and 64 "
        "(CPU: --preset tiny; GPU: --preset llama-3.1-8b)",
    ),
    "multi-model": BenchCommand(
        "ember.bench.multi_model",
        "add_arguments",
        "run",
        "several models in one server: traffic split across them, sleeps and wakes, stalls, wake "
        "and load times",
    ),
}

API_KEY_ENV = "EMBER_API_KEY"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "models",
        nargs="*",
        metavar="[NAME=]SOURCE",
        help="the models to serve, each a .gguf file, a model directory, a Hugging Face model "
        "id in the local cache, or s3://BUCKET/PREFIX (an S3-compatible store, configured by "
        "the AWS_* variables or ~/.aws), served as NAME (default: SOURCE as given); the first "
        "answers requests that name no model (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of models to serve (after those on the command line) and their "
        "settings, and engine-wide settings (README.md, 'Several models on one GPU')",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        help="the name clients use in 'model' (default: MODEL as given); one model only",
    )
    defaults = engine_config()
    memory = MemoryConfig()
    parser.add_argument(
        "--dtype",
        help="auto (float32 on CPU, the checkpoint's bf16/fp16 on GPU; the default), float32, "
        "float16, bfloat16",
    )
    parser.add_argument("--device", help="auto (the default), cuda, cuda:N or cpu")
    parser.add_argument(
        "--download-dir",
        metavar="DIR",
        help="where models from an object store are cached (default: ember's directory in the "
        "user's cache directory)",
    )
    parser.add_argument(
        "--kernel-cache-dir",
        metavar="DIR",
        help="where compiled kernels are kept between starts, one directory per GPU model and "
        "versions (default: ember's directory in the user's cache directory; a TRITON_CACHE_DIR "
        "you set wins)",
    )
    parser.add_argument(
        "--kernel-tuning",
        metavar="FILE",
        help="a tune.json from `ember bench tune --sections moe` on this GPU: the fused MoE "
        "kernels launch with its measured tiles (default: the tables shipped for this GPU "
        "model, else heuristics)",
    )
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help=f"fraction of GPU memory for all models' weights and KV caches "
        f"(default: {memory.gpu_memory_utilization})",
    )
    parser.add_argument(
        "--memory-budget-bytes",
        type=int,
        help="a memory budget in bytes for all models, instead of --gpu-memory-utilization "
        "(on a CPU: no limit by default)",
    )
    parser.add_argument(
        "--sleep-host-memory-bytes",
        type=int,
        help="pinned host memory holding sleeping models' weights (default: no bound; past it "
        "a sleeping model's weights are read again from its checkpoint on wake)",
    )
    parser.add_argument(
        "--model-load-timeout",
        type=float,
        metavar="SECONDS",
        help="how long a request may wait for its model to load or wake, then 503 "
        f"(default: {DEFAULT_MODEL_LOAD_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--pinned",
        action="store_true",
        default=None,
        help="never put the models to sleep to make room for another",
    )
    parser.add_argument(
        "--idle-timeout",
        dest="idle_timeout_s",
        type=float,
        metavar="SECONDS",
        help="put a model to sleep after this long without a request (default: only to make "
        "room for another model)",
    )
    parser.add_argument(
        "--no-preload",
        dest="preload",
        action="store_false",
        default=None,
        help="load each model at its first request, not at start",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help=f"sequences per step (default: {defaults.limits.max_num_seqs})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help=f"tokens per step (default: {defaults.limits.max_num_batched_tokens}, or the "
        "context length if larger)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        help=f"tokens per KV cache block (default: {defaults.cache.block_size})",
    )
    parser.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        help="KV cache blocks, instead of sizing the pool from memory (also on CPU)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes", type=int, help="KV cache budget in bytes (CPU: 1 GiB default)"
    )
    parser.add_argument(
        "--seed", type=int, help=f"seed for unseeded requests (default: {defaults.seed})"
    )
    parser.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    parser.add_argument(
        "--lazy-cuda-graphs",
        action="store_true",
        default=None,
        help="capture each CUDA graph when a step first needs it (faster start, slower first steps)",
    )
    parser.add_argument(
        "--cuda-graph-mode",
        choices=CUDA_GRAPH_MODES,
        help="full (the default): CUDA graphs for decode and prefill steps; decode: decode "
        "steps only",
    )
    add_fast_path_arguments(parser)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--chat-template", help="a chat template file, or the template itself (every model's)"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests that may wait for the engine per model; beyond, 429 with Retry-After",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger bodies get 413",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="seconds running requests may take to finish after SIGTERM; then they are aborted",
    )
    restart = RestartPolicy()
    parser.add_argument(
        "--max-engine-restarts",
        type=int,
        default=restart.max_losses,
        metavar="N",
        help=f"start a new engine process when one is lost, up to N times within "
        f"{restart.window_s:.0f} s; one more loss ends the server with exit code 1 (0: never "
        f"restart; default: {restart.max_losses})",
    )
    parser.add_argument("--uvicorn-log-level", default="info")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted for vLLM compatibility; ember logs no periodic stats",
    )
    parser.add_argument(
        "--disable-progress-bar", action="store_true", help="no progress bar while loading"
    )
    add_vllm_arguments(parser)


def add_fast_path_arguments(parser: argparse.ArgumentParser) -> None:
    """Switches between kernel schedules of the Triton path (for A/B measurements)."""
    parser.add_argument(
        "--programmatic-launch",
        nargs="?",
        const="on",
        choices=PDL_MODES,
        help="launch a step's Triton kernels with programmatic dependent launch (Hopper+): at the "
        "step sizes where it measured faster on the GPU (auto, the default), always (on, or the "
        "bare flag) or never (off)",
    )
    parser.add_argument(
        "--separate-decode-rope",
        action="store_true",
        help="decode steps apply RoPE and write the KV cache in their own kernel, not inside "
        "the attention kernel",
    )
    parser.add_argument(
        "--separate-norms",
        action="store_true",
        help="run each decoder RMSNorm as its own kernel instead of folding its weight into the "
        "next projection and deferring 1/rms to the kernel that reads it",
    )
    parser.add_argument(
        "--fp8-widen-in-registers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FP8 weight tiles (the skinny GEMM's, the fused MoE's) and an FP8 KV cache's widen to "
        "bf16 by their bits in PTX instead of Triton's conversions (default: on; the same "
        "values, faster where the conversions bound the step)",
    )
    parser.add_argument(
        "--compile-workers",
        type=int,
        metavar="N",
        help="threads that compile the CUDA graphs' Triton kernels before the captures "
        "(default: one per CPU, up to 16; 0: each kernel compiles at its first launch)",
    )


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """How a benchmark that loads a model in its own process loads it (as `ember serve`'s)."""
    parser.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        help="dummy: no weight is read; random ones are made on the device from the model's "
        "config.json (`ember bench make-model --config-only` writes one)",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        help="fp8: the linear layers' (and experts') weights quantized to float8 as they load",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help="split the model over this many GPUs (as `ember serve`'s; CUDA graphs off past 1)",
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `engine_config` options that `ember serve`'s (or a benchmark's) flags set; flags
    left out are left out, so each keeps the one default `ember.config` defines."""
    options = {
        name: getattr(args, name)
        for name in ENGINE_OPTIONS
        if getattr(args, name, None) is not None
    }
    if getattr(args, "separate_decode_rope", False):
        options["decode_rope_in_attention"] = False
    if getattr(args, "separate_norms", False):
        options["defer_norms"] = False
    if options.get("quantization") not in (None, *QUANTIZATION_CHOICES):
        del options["quantization"]  # gguf: what a .gguf model does anyway; others refused
    if options.get("load_format") in SOURCE_FORMATS:
        del options["load_format"]  # checked against the sources: what "auto" does
    return options


def parse_model_argument(text: str) -> tuple[str | None, str]:
    """``(NAME, SOURCE)`` of a ``[NAME=]SOURCE`` argument (NAME None when not given). It is
    split at its first '=' only where what comes before is a plain name (no '/') and something
    comes after, and never when the whole argument exists on disk (a path with '=' in it)."""
    name, equals, source = text.partition("=")
    if not equals or not name or not source or "/" in name or os.sep in name:
        return None, text
    if os.path.exists(text):
        return None, text
    return name, source


def command_line_models(args: argparse.Namespace) -> list[ModelEntry]:
    """The models `ember serve`'s positional arguments name, in order (none: an empty list);
    ValueError where --served-model-name cannot apply."""
    arguments = list(getattr(args, "models", None) or ())
    served_model_name = getattr(args, "served_model_name", None)
    if served_model_name and len(arguments) > 1:
        raise ValueError(
            f"--served-model-name names one model, but {len(arguments)} are given; "
            "name each as NAME=SOURCE instead"
        )
    entries = []
    for text in arguments:
        name, source = parse_model_argument(text)
        if name and served_model_name:
            raise ValueError(f"{text!r} names its model already; leave out --served-model-name")
        entries.append(
            ModelEntry(source, name=name or served_model_name, origin=f"the argument {text!r}")
        )
    return entries


def server_config(args: argparse.Namespace):
    """The ServerConfig described by `ember serve` flags (and its --config file); ValueError
    for a mistake in either, naming the file where it is there."""
    from ember.server.config import ServerConfig
    from ember.server.config_file import ConfigFile, build_specs, load_config_file

    file = load_config_file(args.config) if getattr(args, "config", None) else ConfigFile("")
    entries = command_line_models(args)
    if file.models and args.served_model_name:
        raise ValueError(
            f"--served-model-name names one model, but {file.path} lists models too; "
            "name each model in its own place instead"
        )
    entries += file.models
    if not entries:  # the embedded default model
        entries = [ModelEntry(None, name=args.served_model_name)]
    defaults = engine_options(args)
    defaults.pop("served_model_name", None)  # each model's own
    parsers = {  # every model's, unless its [[models]] table names its own
        key: value
        for key in ("tool_call_parser", "reasoning_parser")
        if (value := getattr(args, key, None))
    }
    models = build_specs(entries, defaults, args.chat_template, parsers)
    for note in check_vllm_flags(args, [spec.engine.model for spec in models]):
        log.warning("ember serve: %s", note)
    memory = dict(file.memory)  # a flag given wins over the file
    memory.update(
        (name, getattr(args, name)) for name in MEMORY_OPTIONS if getattr(args, name) is not None
    )
    load_timeout = args.model_load_timeout
    if load_timeout is None:
        load_timeout = file.model_load_timeout_s
    if load_timeout is None:
        load_timeout = DEFAULT_MODEL_LOAD_TIMEOUT_S
    return ServerConfig(
        models=models,
        memory=memory_config(**memory),
        model_load_timeout_s=load_timeout,
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        max_queue=args.max_queue,
        max_body_bytes=args.max_request_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        show_progress=not args.disable_progress_bar,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        engine_restart=RestartPolicy(max_losses=args.max_engine_restarts),
        **http_options(args),
    )


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = server_config(args)
    except (ValueError, OSError) as error:
        log.error("ember serve: %s", error)
        return 1
    from ember.server.serve import run_server

    return run_server(config)


def run_bench(args: argparse.Namespace) -> int:
    """Build the chosen benchmark's own parser (importing only its module) and run it."""
    command = BENCH_COMMANDS[args.benchmark]
    module = importlib.import_module(command.module)
    parser = argparse.ArgumentParser(prog=f"ember bench {args.benchmark}", description=command.help)
    getattr(module, command.add_arguments)(parser)
    return int(getattr(module, command.run)(parser.parse_args(args.bench_args)) or 0)


def run_kernels(args: argparse.Namespace) -> int:
    """`ember kernels path|publish`: this GPU's compiled-kernel cache."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch

    from ember.kernels import kernel_cache
    from ember.weights.object_store import ObjectStoreError

    device = torch.device(args.device)
    if args.action == "path":
        key = kernel_cache.cache_key(device)
        root = kernel_cache.cache_root(args.kernel_cache_dir)
        print(kernel_cache.managed_dir(key, root) or os.environ.get("TRITON_CACHE_DIR"))
        return 0
    if not args.url:
        log.error("ember kernels publish: give the model's s3://BUCKET/PREFIX")
        return 2
    try:
        print(kernel_cache.publish(args.url, device, args.kernel_cache_dir))
    except (ObjectStoreError, ValueError) as error:
        log.error("ember kernels publish: %s", error)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="An LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve models over the OpenAI API",
        description="Serve one model, or several sharing the GPU, over the OpenAI API (a "
        "drop-in for `vllm serve`). Per-model flags (--dtype, --max-model-len, --pinned, "
        "--chat-template, ...) set every model's default; a model's table in --config "
        "overrides them. Engine-wide flags (--gpu-memory-utilization, --memory-budget-bytes, "
        "--sleep-host-memory-bytes, --model-load-timeout) win over the file's.",
    )
    add_serve_arguments(serve)
    serve.set_defaults(run=run_serve, usage_error=serve.error)
    kernels = commands.add_parser(
        "kernels",
        help="this GPU's compiled-kernel cache: where it is, or publish it beside a model",
        description="`path`: the directory of compiled kernels for this GPU and these versions. "
        "`publish s3://BUCKET/PREFIX`: put it beside the model there, so that nodes starting "
        "the model from the store fetch the kernels instead of compiling them.",
    )
    kernels.add_argument("action", choices=("path", "publish"))
    kernels.add_argument("url", nargs="?", help="the model's s3://BUCKET/PREFIX (publish)")
    kernels.add_argument("--device", default="cuda", help="the GPU (default: cuda)")
    kernels.add_argument("--kernel-cache-dir", metavar="DIR", help="as `ember serve`'s")
    kernels.set_defaults(run=run_kernels)
    bench = commands.add_parser("bench", help="benchmarks")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, command in BENCH_COMMANDS.items():
        # Its flags go to the benchmark's own parser (see main), so its module loads only
        # when it runs.
        sub = benchmarks.add_parser(name, help=command.help, add_help=False)
        sub.set_defaults(run=run_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = rest
    elif args.command == "serve" and rest and not any(arg.startswith("-") for arg in rest):
        args.models += rest  # models after flags: `ember serve a --port 8001 b`
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        try:
            command_line_models(args)
        except ValueError as error:
            args.usage_error(str(error))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
