"""The `ember` command: `ember serve [MODEL] ...` and `ember bench <benchmark> ...`.

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
from typing import NamedTuple

from ember.config import PDL_MODES
from ember.server.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
)


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
        "sweep GEMM (cuBLAS vs skinny Triton) and decode-attention tiles on a GPU",
    ),
    "head-split": BenchCommand(
        "ember.bench.head_split",
        "add_arguments",
        "run",
        "attention overlapped with the q/k/v and o GEMMs by KV-head groups, against the chain",
    ),
    "targets": BenchCommand(
        "ember.bench.targets",
        "add_arguments",
        "run",
        "compare recorded step/serve/peer results with the project's targets",
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
        "host-side cost of one engine step (schedule, stage inputs, update), no model",
    ),
}

API_KEY_ENV = "EMBER_API_KEY"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a .gguf file, a model directory, or a Hugging Face model id in the local cache "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name", help="the name clients use in 'model' (default: MODEL as given)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (float32 on CPU, the checkpoint's bf16/fp16 on GPU), float32, float16, bfloat16",
    )
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="tokens per step (default: 2048 or more)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        dest="num_kv_blocks",
        help="KV cache blocks, instead of sizing the pool from memory (also on CPU)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes", type=int, help="KV cache budget in bytes (CPU: 1 GiB default)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for unseeded requests")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--lazy-cuda-graphs",
        action="store_true",
        help="capture each CUDA graph when a step first needs it (faster start, slower first steps)",
    )
    parser.add_argument(
        "--cuda-graph-mode",
        choices=("full", "decode"),
        default="full",
        help="full: CUDA graphs for decode and prefill steps; decode: decode steps only",
    )
    add_fast_path_arguments(parser)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--chat-template", help="a chat template file, or the template itself")
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
        help="seconds running requests may take to finish after SIGTERM",
    )
    parser.add_argument("--uvicorn-log-level", default="info")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument(
        "--disable-log-stats",
        "--disable-log-requests",
        action="store_true",
        help="accepted for vLLM compatibility; no effect",
    )
    parser.add_argument(
        "--disable-progress-bar", action="store_true", help="no progress bar while loading"
    )


def add_fast_path_arguments(parser: argparse.ArgumentParser) -> None:
    """Switches between kernel schedules of the Triton path (for A/B measurements)."""
    parser.add_argument(
        "--programmatic-launch",
        nargs="?",
        const="on",
        default="auto",
        choices=PDL_MODES,
        help="launch a step's Triton kernels with programmatic dependent launch (Hopper+): at the "
        "step sizes where it measured faster on an H200 (auto, the default), always (on, or the "
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
        "--compile-workers",
        type=int,
        default=None,
        metavar="N",
        help="threads that compile the CUDA graphs' Triton kernels before the captures "
        "(default: one per CPU, up to 16; 0: each kernel compiles at its first launch)",
    )


def fast_path_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields set by `add_fast_path_arguments`."""
    return {
        "programmatic_launch": args.programmatic_launch,
        "decode_rope_in_attention": not args.separate_decode_rope,
        "defer_norms": not args.separate_norms,
        "compile_workers": args.compile_workers,
    }


def server_config(args: argparse.Namespace):
    """The ServerConfig described by `ember serve` flags."""
    from ember.config import CacheConfig, EngineConfig, SchedulerConfig
    from ember.server.config import ServedModelSpec, ServerConfig
    from ember.server.models import served_name_for

    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        served_model_name=served_name_for(args.model, args.served_model_name),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens
            or max(2048, args.max_model_len or 0),
            max_model_len=args.max_model_len or 0,
        ),
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        lazy_cuda_graphs=args.lazy_cuda_graphs,
        cuda_graph_mode=args.cuda_graph_mode,
        **fast_path_options(args),
    )
    return ServerConfig(
        models=(ServedModelSpec(engine, chat_template=args.chat_template),),
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        max_queue=args.max_queue,
        max_body_bytes=args.max_request_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        show_progress=not args.disable_progress_bar,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
    )


def run_serve(args: argparse.Namespace) -> int:
    from ember.server.serve import run_server

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_server(server_config(args))


def run_bench(args: argparse.Namespace) -> int:
    """Build the chosen benchmark's own parser (importing only its module) and run it."""
    command = BENCH_COMMANDS[args.benchmark]
    module = importlib.import_module(command.module)
    parser = argparse.ArgumentParser(prog=f"ember bench {args.benchmark}", description=command.help)
    getattr(module, command.add_arguments)(parser)
    return int(getattr(module, command.run)(parser.parse_args(args.bench_args)) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="An LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        description="Serve a model over the OpenAI API (a drop-in for `vllm serve`).",
    )
    add_serve_arguments(serve)
    serve.set_defaults(run=run_serve)
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
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
