"""`ember serve --config FILE`: the models to serve and their settings, from a TOML file.

The format (every key is optional but a model's ``source``)::

    # engine-wide
    gpu_memory_utilization = 0.9            # the process's share of the GPU, all models together
    memory_budget_bytes = 30_000_000_000    # or a budget in bytes (on a CPU, the only one)
    sleep_host_memory_bytes = 64_000_000_000  # pinned host memory for sleeping models' weights
    model_load_timeout = 300                # seconds a request may wait for its model to load
                                            # or wake (then 503 with Retry-After)

    [[models]]                              # one table per model, in the order served
    source = "/models/llama-3.1-8b"         # required: HF directory, HF cache id, GGUF file,
                                            # or s3://bucket/prefix (an S3-compatible store)
    download_dir = "/var/cache/ember"       # where an s3:// model is cached
    name = "llama"                          # the served name (default: source as written)
    aliases = ["llama-8b"]                  # further names clients may use for it
    chat_template = "llama.jinja"           # a template file, or the template itself
    tool_call_parser = "hermes"             # how it writes tool calls (--tool-call-parser)
    reasoning_parser = "qwen3"              # how it writes its reasoning (--reasoning-parser)
    pinned = true                           # never put to sleep
    idle_timeout = 600                      # seconds without a request before it sleeps
    preload = true                          # load at start if it fits without evicting another
    memory_share = 0.5                      # its fraction of the memory budget, or else
    kv_cache_memory_bytes = 4_000_000_000   # its KV cache in bytes
    kv_cache_dtype = "fp8"                  # its KV cache in float8 (default "auto")
    quantization = "fp8"                    # its linear layers quantized to float8 at load
    max_model_len = 8192                    # and any other engine option (ENGINE_OPTIONS),
    dtype = "bfloat16"                      # named as `ember serve`'s flag, with underscores

A relative ``source`` or ``chat_template`` path is taken from the file's folder when it exists
there (else as written: from the working directory, or an HF cache id, or template text).

`ember serve`'s per-model flags (``--dtype``, ``--max-model-len``, ``--pinned``,
``--chat-template``, ``--tool-call-parser``, ``--reasoning-parser``, ...) are the defaults of
every model; a model's key here overrides them.
Its engine-wide flags win over this file's engine-wide keys. Every mistake (an unknown key, a
wrong type, a value out of range, a served name given twice) is a ValueError naming the file.
"""

from __future__ import annotations

import difflib
import os
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.config import (
    ENGINE_OPTIONS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MEMORY_OPTIONS,
    PDL_MODES,
    QUANTIZATION_CHOICES,
    CacheConfig,
    EngineConfig,
    MemoryConfig,
    ModelPolicy,
    StepLimits,
    engine_config,
)
from ember.server.config import ServedModelSpec
from ember.server.reasoning.selection import REASONING_PARSER_NAMES
from ember.server.tool_calls.registry import PARSER_NAMES

CUDA_GRAPH_MODES = ("full", "decode")

# How a model's replies are read: the front end's keys of a [[models]] table, and their choices.
_PARSER_KEYS = {"tool_call_parser": PARSER_NAMES, "reasoning_parser": REASONING_PARSER_NAMES}
# Keys of a [[models]] table that are not engine options under the same name.
_MODEL_KEYS = ("source", "name", "aliases", "chat_template", "idle_timeout", *_PARSER_KEYS)
# Engine options a [[models]] table spells otherwise (name) or under a key of its own.
_RENAMED_OPTIONS = {"served_model_name": "name", "idle_timeout_s": "idle_timeout"}
# Engine-wide keys beside the memory options.
_TOP_KEYS = ("model_load_timeout", "models")
# An engine option whose field has another name than the option.
_OPTION_FIELDS = {"num_gpu_blocks_override": "num_blocks"}


@dataclass(frozen=True)
class ModelEntry:
    """One model as given on the command line or in the file, before the flags' defaults
    apply. ``source`` None is the embedded default model; ``name`` None: the source's own
    served name; ``options``: `engine_config` options this model sets itself; ``parsers``:
    the reply parsers it names (`tool_call_parser`, `reasoning_parser`)."""

    source: str | None
    name: str | None = None
    aliases: tuple[str, ...] = ()
    chat_template: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    parsers: Mapping[str, str] = field(default_factory=dict)
    origin: str = "the command line"  # where it was given, for error messages


@dataclass(frozen=True)
class ConfigFile:
    """What a config file says: its models, the memory options it sets and the model load
    timeout (None: not set)."""

    path: str
    models: tuple[ModelEntry, ...] = ()
    memory: Mapping[str, Any] = field(default_factory=dict)
    model_load_timeout_s: float | None = None


def load_config_file(path: str | os.PathLike[str]) -> ConfigFile:
    """Read and check a config file; ValueError (naming the file) on any mistake."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from error
    except OSError as error:
        raise ValueError(f"cannot read the config file {path}: {error.strerror}") from error
    return parse_config(data, str(path), Path(path).parent)


def parse_config(data: Mapping[str, Any], path: str, base_dir: Path | None = None) -> ConfigFile:
    """Check the decoded TOML of the file at ``path``; relative paths in it are looked up in
    ``base_dir`` first (None: only as written)."""
    memory_types = _field_types(MemoryConfig)
    allowed = (*MEMORY_OPTIONS, *_TOP_KEYS)
    for key in data:
        if key not in allowed:
            if key in _model_keys():
                hint = "; it is a per-model key: put it in a [[models]] table"
            else:
                hint = _suggest(key, allowed) or f"; engine-wide keys: {', '.join(allowed)}"
            raise ValueError(f"{path}: unknown key {key!r}{hint}")
    memory = {
        key: _checked(data[key], memory_types[key], key, path)
        for key in MEMORY_OPTIONS
        if key in data
    }
    load_timeout = (
        _checked(data["model_load_timeout"], float, "model_load_timeout", path)
        if "model_load_timeout" in data
        else None
    )
    tables = data.get("models", [])
    if not isinstance(tables, list) or not all(isinstance(table, dict) for table in tables):
        raise ValueError(f"{path}: 'models' must be tables, each starting with [[models]]")
    models = tuple(
        _model_entry(table, f"{path}, [[models]] #{number}", base_dir)
        for number, table in enumerate(tables, start=1)
    )
    return ConfigFile(path, models, memory, load_timeout)


def build_specs(
    entries: Iterable[ModelEntry],
    defaults: Mapping[str, Any],
    chat_template: str | None = None,
    parsers: Mapping[str, str | None] | None = None,
) -> tuple[ServedModelSpec, ...]:
    """Each model's ServedModelSpec: ``defaults`` (engine options from flags),
    ``chat_template`` and ``parsers`` (`tool_call_parser`, `reasoning_parser` from flags)
    apply where the entry sets nothing of its own. ValueError when one name (served name or
    alias) is given twice, or pinned models' memory shares pass the budget."""
    from ember.server.models import served_name_for

    specs = []
    given_by: dict[str, str] = {}
    for entry in entries:
        name = entry.name or served_name_for(entry.source, None)
        for served in (name, *entry.aliases):
            if served in given_by:
                where = given_by[served]
                also = "" if where == entry.origin else f" and by {entry.origin}"
                raise ValueError(f"the served name {served!r} is given twice: by {where}{also}")
            given_by[served] = entry.origin
        options = {**defaults, **entry.options, "served_model_name": name}
        engine = engine_config(entry.source, **options)
        template = entry.chat_template if entry.chat_template is not None else chat_template
        reading = {**(parsers or {}), **entry.parsers}
        specs.append(
            ServedModelSpec(engine, chat_template=template, aliases=entry.aliases, **reading)
        )
    pinned = [spec for spec in specs if spec.engine.policy.pinned]
    shares = sum(spec.engine.policy.memory_share or 0.0 for spec in pinned)
    if shares > 1.0 + 1e-9:
        names = ", ".join(spec.name for spec in pinned)
        raise ValueError(
            f"the pinned models ({names}) never sleep, yet their memory shares add up to "
            f"{shares:g}, more than the whole budget"
        )
    return tuple(specs)


def _model_entry(table: Mapping[str, Any], where: str, base_dir: Path | None) -> ModelEntry:
    option_types = _option_types()
    keys = _model_keys()
    for key in table:
        if key not in keys:
            renamed = _RENAMED_OPTIONS.get(key)
            hint = (f" (here it is {renamed!r})" if renamed else _suggest(key, keys)) or (
                f"; model keys: {', '.join(_MODEL_KEYS)}, and the engine options "
                f"{', '.join(_file_options())}"
            )
            raise ValueError(f"{where}: unknown key {key!r}{hint}")
    if "source" not in table:
        raise ValueError(f"{where}: no 'source' (a model directory, an HF id or a .gguf file)")
    source = _checked(table["source"], str, "source", where)
    if not source:
        raise ValueError(f"{where}: 'source' is empty")
    if "name" in table:
        name = _checked(table["name"], str, "name", where)
        if not name:
            raise ValueError(f"{where}: 'name' is empty")
    else:
        from ember.server.models import served_name_for

        name = served_name_for(source, None)  # the source as written
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ValueError(f"{where}: 'aliases' must be a list of names, not {aliases!r}")
    template = table.get("chat_template")
    if template is not None:
        template = _beside(_checked(template, str, "chat_template", where), base_dir, template=True)
    options = {
        option: _checked(table[key], option_types[option], key, where)
        for key, option in _file_option_keys().items()
        if key in table
    }
    if "kernel_tuning" in options:
        options["kernel_tuning"] = _beside(options["kernel_tuning"], base_dir)
    parsers = {key: _parser(table[key], key, where) for key in _PARSER_KEYS if key in table}
    return ModelEntry(
        source=_beside(source, base_dir),
        name=name,
        aliases=tuple(aliases),
        chat_template=template,
        options=options,
        parsers=parsers,
        origin=f"{where} ({name!r})",
    )


def _parser(value: Any, key: str, where: str) -> str:
    choices = _PARSER_KEYS[key]
    if value not in choices:
        raise ValueError(f"{where}: {key} must be one of {', '.join(choices)}, not {value!r}")
    return value


def _beside(value: str, base_dir: Path | None, template: bool = False) -> str:
    """``value`` as a path from the file's folder where one exists there, else as written."""
    if base_dir is None or os.path.isabs(value) or (template and "\n" in value):
        return value
    candidate = os.path.join(base_dir, value)
    return candidate if os.path.exists(candidate) else value


def _file_option_keys() -> dict[str, str]:
    """The engine options a [[models]] table sets, by their key in the table."""
    return {
        _RENAMED_OPTIONS.get(option, option): option
        for option in ENGINE_OPTIONS
        if option != "served_model_name"
    }


def _file_options() -> list[str]:
    return sorted(set(_file_option_keys()) - set(_MODEL_KEYS))


def _model_keys() -> tuple[str, ...]:
    return (*_MODEL_KEYS, *_file_options())


def _field_types(*classes: type) -> dict[str, Any]:
    hints: dict[str, Any] = {}
    for cls in classes:
        hints.update(typing.get_type_hints(cls))
    return hints


def _option_types() -> dict[str, Any]:
    """The type each engine option takes, from its dataclass field (Any where none is found)."""
    hints = _field_types(CacheConfig, StepLimits, ModelPolicy, EngineConfig)
    return {option: hints.get(_OPTION_FIELDS.get(option, option), Any) for option in ENGINE_OPTIONS}


def _positive(value: float) -> bool:
    return value > 0


def _non_negative(value: float) -> bool:
    return value >= 0


def _fraction(value: float) -> bool:
    return 0 < value <= 1


# Values outside these are refused (by the key's name in the file).
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(
        (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_gpu_blocks_override",
            "kv_cache_memory_bytes",
            "memory_budget_bytes",
            "idle_timeout",
            "model_load_timeout",
        ),
        (_positive, "greater than 0"),
    ),
    **dict.fromkeys(
        (
            "max_model_len",
            "long_prefill_token_threshold",
            "compile_workers",
            "sleep_host_memory_bytes",
        ),
        (_non_negative, "0 or more"),
    ),
    **dict.fromkeys(
        ("memory_share", "gpu_memory_utilization"), (_fraction, "greater than 0, at most 1")
    ),
}
_CHOICES = {
    "programmatic_launch": PDL_MODES,
    "cuda_graph_mode": CUDA_GRAPH_MODES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "quantization": QUANTIZATION_CHOICES,
    "load_format": LOAD_FORMATS,
}
_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _checked(value: Any, hint: Any, key: str, where: str) -> Any:
    """``value`` if TOML gave it as the type ``hint`` names (an int as a float where a float is
    asked) and in its key's range and choices; else ValueError."""
    kinds = _kinds(hint)
    result = _as_kind(value, kinds)
    if result is _NO_MATCH:
        wanted = " or ".join(
            _KIND_NAMES.get(kind, getattr(kind, "__name__", str(kind))) for kind in kinds
        )
        raise ValueError(f"{where}: {key} must be {wanted}, not {value!r}")
    if key in _RANGES:
        in_range, expected = _RANGES[key]
        if not in_range(result):
            raise ValueError(f"{where}: {key} must be {expected}, not {value!r}")
    if key in _CHOICES and result not in _CHOICES[key]:
        raise ValueError(f"{where}: {key} must be one of {', '.join(_CHOICES[key])}, not {value!r}")
    return result


_NO_MATCH = object()


def _kinds(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(arg for arg in typing.get_args(hint) if arg is not type(None))
    return (hint,)


def _as_kind(value: Any, kinds: tuple[Any, ...]) -> Any:
    for kind in kinds:
        if kind is Any:
            return value
        if isinstance(value, bool):
            if kind is bool:
                return value
            continue  # TOML's true is no number
        if kind is float and isinstance(value, int | float):
            return float(value)
        if isinstance(kind, type) and isinstance(value, kind):
            return value
    return _NO_MATCH


def _suggest(key: str, known: Iterable[str]) -> str:
    known = list(known)
    spelled = key.replace("-", "_")
    if spelled != key and spelled in known:
        return f" (keys use underscores: {spelled!r})"
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
