"""The `vllm serve` flags that scripts pass, each implemented, accepted as what ember does
anyway, or refused: a refused flag stops `ember serve` with one line naming it and why, before
anything loads, so no script runs on a setting it did not get."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from ember.config import KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATION_CHOICES
from ember.server.config import CorsConfig
from ember.server.reasoning.selection import REASONING_PARSER_NAMES
from ember.server.tool_calls.registry import PARSER_NAMES

# --load-format values that name what a model's source is: checked against every model, and
# then what "auto" does.
SOURCE_FORMATS = ("safetensors", "gguf")
# ember computes at most this many alternatives per token (vLLM's default --max-logprobs).
MAX_LOGPROBS = 20


class RefusedFlag(ValueError):
    """A flag ember cannot honour; the message names it."""

    def __init__(self, flag: str, why: str) -> None:
        super().__init__(f"{flag}: {why}")


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags in three groups: the model's format, HTTP, and logging."""
    model = parser.add_argument_group(
        "model format (vLLM's flags: what ember does, else refused at start)"
    )
    model.add_argument(
        "--load-format",
        choices=(*LOAD_FORMATS, *SOURCE_FORMATS),
        help="auto (the default: from the source), safetensors (a model directory) or gguf "
        "(a .gguf file), one that does not match a model refused; dummy: no weight is read, "
        "random ones (seeded by --seed) are made on the device from the model's config.json, "
        "for benchmarks of shapes whose checkpoint is not on disk (`ember bench make-model "
        "--config-only` writes such a folder)",
    )
    model.add_argument(
        "--quantization",
        "-q",
        help="fp8: the linear layers' weights in float8 e4m3 with a scale per output channel, "
        "quantized as they load (a checkpoint of FP8 weights, compressed-tensors or "
        "quant_method fp8, loads as it is without the flag); gguf, for .gguf models, is what "
        "they do anyway; others are refused",
    )
    model.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="auto (the default): keys and values in the model's dtype; fp8 or fp8_e4m3: in "
        "float8 e4m3 with a scale per layer for each (1.0 by default), twice the tokens in the "
        "same memory",
    )
    model.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="automatic prefix caching: full KV blocks kept after a request and shared by later "
        "requests with the same prefix (default: on)",
    )
    model.add_argument(
        "--generation-config",
        metavar="auto|vllm",
        help="auto or vllm: EOS ids come from the model's generation_config.json, sampling "
        "defaults are the OpenAI API's (a folder is refused)",
    )
    model.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help="split each model over this many GPUs of this host (default 1): one worker "
        "process per GPU past the first (every architecture ember serves, mixtures of experts "
        "with each expert split over the GPUs; CUDA graphs and sleep are off at more than 1 "
        "for now; docs/scaling.md)",
    )
    model.add_argument(
        "--max-logprobs",
        type=int,
        help=f"{MAX_LOGPROBS} only: the most logprobs a request may ask for per token",
    )
    model.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted, no effect: ember never runs a model's own code",
    )
    model.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted, no effect: ember serves tool_choice auto whenever it knows the model's "
        "tool-call format (--tool-call-parser, else its chat template's)",
    )
    model.add_argument(
        "--tool-call-parser",
        choices=PARSER_NAMES,
        help="how every model writes tool calls (default: the format its chat template shows; "
        "openai: gpt-oss's harmony format, read with its channels)",
    )
    model.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSER_NAMES,
        help="how every model writes its reasoning, read into reasoning_content: qwen3 or "
        "deepseek_r1 (between <think> and </think>; deepseek_r1 reads a reply as reasoning until "
        "</think>), openai_gptoss (gpt-oss's harmony analysis channel, the default for a "
        "tokenizer with harmony's special tokens)",
    )
    http = parser.add_argument_group("HTTP: TLS, CORS, root path")
    http.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this key")
    http.add_argument("--ssl-certfile", metavar="FILE", help="and this certificate")
    http.add_argument("--root-path", default="", help="the path prefix a proxy serves ember under")
    http.add_argument(
        "--allowed-origins",
        type=_json_list,
        help="CORS: allowed origins, a JSON list ('[\"https://a.example\"]'); CORS is off "
        'unless one of these four flags is given, and a list left out is then ["*"]',
    )
    http.add_argument("--allowed-methods", type=_json_list, help="CORS: allowed methods")
    http.add_argument("--allowed-headers", type=_json_list, help="CORS: allowed headers")
    http.add_argument(
        "--allow-credentials", action="store_true", default=None, help="CORS: allow credentials"
    )
    http.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info: a model's special tokens, chat template and context "
        "length (what lm-evaluation-harness's remote tokenizer reads); off by default, as in vLLM",
    )
    logs = parser.add_argument_group("logging")
    requests = logs.add_mutually_exclusive_group()
    requests.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        default=False,
        help="log each API request with its body (cut to 1000 characters)",
    )
    requests.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="no such lines (the default)",
    )


def check_vllm_flags(args: argparse.Namespace, sources: Sequence[str | None]) -> list[str]:
    """Notes to log for the flags given; RefusedFlag for the first one ember cannot honour.
    ``sources``: every served model's source (None: the embedded GGUF model)."""
    gguf = [source is None or _is_gguf(source) for source in sources]
    notes = []
    load_format = getattr(args, "load_format", None)
    if load_format == "gguf" and not all(gguf):
        raise RefusedFlag("--load-format", "gguf needs every model to be a .gguf file")
    if load_format == "safetensors" and any(gguf):
        raise RefusedFlag(
            "--load-format", "safetensors needs every model to be a model directory, not a .gguf"
        )
    quantization = getattr(args, "quantization", None)
    accepted = quantization in QUANTIZATION_CHOICES or (quantization == "gguf" and all(gguf))
    if quantization is not None and not accepted:
        raise RefusedFlag(
            "--quantization",
            f"{quantization} is not available; ember serves fp8 (quantized at load), a "
            "checkpoint in its own dtype (FP8 ones too, no flag needed), and a .gguf file with "
            "the quantization it carries",
        )
    notes += _generation_config_notes(getattr(args, "generation_config", None))
    if getattr(args, "max_logprobs", None) not in (None, MAX_LOGPROBS):
        raise RefusedFlag(
            "--max-logprobs", f"only {MAX_LOGPROBS}: ember's bound on logprobs is fixed"
        )
    if getattr(args, "trust_remote_code", False):
        notes.append("--trust-remote-code has no effect: ember never runs a model's own code")
    _check_ssl(args)
    return notes


def http_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `ServerConfig` fields of the HTTP and logging flags."""
    lists = {
        name: getattr(args, name, None)
        for name in ("allowed_origins", "allowed_methods", "allowed_headers")
    }
    credentials = getattr(args, "allow_credentials", None)
    cors = None
    if credentials is not None or any(v is not None for v in lists.values()):
        given = {name: tuple(v) for name, v in lists.items() if v is not None}
        cors = CorsConfig(**given, allow_credentials=bool(credentials))
    return {
        "cors": cors,
        "root_path": getattr(args, "root_path", "") or "",
        "ssl_keyfile": getattr(args, "ssl_keyfile", None),
        "ssl_certfile": getattr(args, "ssl_certfile", None),
        "log_requests": bool(getattr(args, "log_requests", False)),
        "tokenizer_info_endpoint": bool(getattr(args, "enable_tokenizer_info_endpoint", False)),
    }


def _generation_config_notes(value: str | None) -> list[str]:
    if value in (None, "vllm"):
        return []
    if value == "auto":
        note = (
            "--generation-config auto: ember takes the EOS ids of the model's "
            "generation_config.json, not its sampling defaults (a request that leaves out "
            "temperature, top_p or top_k gets the OpenAI API's defaults, as with vllm)"
        )
        return [note]
    raise RefusedFlag(
        "--generation-config",
        f"{value!r}: only auto or vllm; a generation config from another folder is not available",
    )


def _check_ssl(args: argparse.Namespace) -> None:
    keyfile, certfile = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    if keyfile and not certfile:
        raise RefusedFlag("--ssl-keyfile", "needs --ssl-certfile")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if path and not os.path.isfile(path):
            raise RefusedFlag(flag, f"{path}: no such file")


def _is_gguf(source: str) -> bool:
    return source.lower().endswith(".gguf")


def _json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM takes them; a bare string is a list of one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return [text]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings")
    return value
