"""A Hugging Face model directory (or HF cache snapshot) as a `Checkpoint`.

Only safetensors weights are read: pickled `*.bin` / `*.pt` files can run code when loaded, so a
directory holding only those is refused. Every weight file's header is checked when the
checkpoint is opened, so a missing, truncated or corrupt shard fails before any memory is
allocated for the model.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from safetensors import SafetensorError, safe_open

from ember.weights.checkpoint import TensorHeader

if TYPE_CHECKING:
    import torch

    from ember.weights.safetensors_layout import TensorExtent
    from ember.weights.weight_files import WeightFiles

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_JINJA_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"
EXTRA_CHAT_TEMPLATES_DIR = "additional_chat_templates"
PICKLED_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# Reads of headers only (tensor names) open files as numpy: `framework="pt"` imports torch,
# which the server's front end (tokenizer only) must not pay for. Only `iter_tensors` needs torch.
_HEADER_FRAMEWORK = "numpy"


class HFDirCheckpoint:
    """config.json + safetensors weights + tokenizer files in one local directory.

    `shard_files` lists the weight files in load order and `total_bytes` their total size, for
    loaders that read the files themselves (in parallel, into pinned buffers) through
    `weight_files`.

    ``weight_files`` given (a download still under way, `ember.weights.object_download`), the
    weight files named by ``arriving`` may not be on disk yet: their headers are read as they
    arrive. ``weights=False`` opens the metadata only (config, tokenizer): no weight file is
    looked for, for a process that never loads the tensors.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        name: str | None = None,
        *,
        weights: bool = True,
        weight_files: WeightFiles | None = None,
        arriving: Collection[str] = (),
    ) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"{self.path}: not a model directory")
        self._name = name or self.path.name
        self._config = read_json(self.path / CONFIG_FILE)
        self.weight_files = weight_files
        self.shard_files: list[Path] = []
        self._index: dict[str, set[str]] = {}
        self._extents: list[TensorExtent] | None = None
        self.total_bytes = 0
        if not weights:
            return
        self.shard_files, self._index = _find_weight_files(self.path, frozenset(arriving))
        for shard in self.shard_files:
            expected = self._index.get(shard.name, set())
            if weight_files is None:
                _check_shard(shard, expected)
            else:
                _check_arriving_shard(shard, expected, weight_files)
        self.total_bytes = sum(self._file_size(shard) for shard in self.shard_files)

    def _file_size(self, shard: Path) -> int:
        if self.weight_files is None:
            return shard.stat().st_size
        fd = self.weight_files.open(shard)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def close(self) -> None:
        """Let go of the weight files (stops a download that is still running)."""
        close = getattr(self.weight_files, "close", None)
        if close is not None:
            close()

    @property
    def name(self) -> str:
        return self._name

    @property
    def hf_config(self) -> dict[str, Any]:
        return dict(self._config)

    @functools.cached_property
    def tokenizer(self) -> tokenizers.Tokenizer:
        path = self.path / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(
                f"{path}: missing; ember needs a tokenizer.json (the Hugging Face `tokenizers` "
                "format), not only a sentencepiece tokenizer.model"
            )
        try:
            return tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust parser raises plain Exception subclasses
            raise ValueError(f"{path}: unreadable tokenizer: {exc}") from exc

    @functools.cached_property
    def tokenizer_config(self) -> dict[str, Any]:
        config = _read_optional_json(self.path / TOKENIZER_CONFIG_FILE)
        template = _read_separate_chat_templates(self.path)
        if template is not None:
            # Newer transformers save the template beside the config; like transformers, the
            # separate files win over an entry left in tokenizer_config.json.
            config["chat_template"] = template
        return config

    @functools.cached_property
    def generation_config(self) -> dict[str, Any]:
        return _read_optional_json(self.path / GENERATION_CONFIG_FILE)

    @functools.cached_property
    def num_tensors(self) -> int:
        """How many tensors `iter_tensors` yields (headers only; for progress bars)."""
        if self.weight_files is not None:  # the files may be arriving still
            return len(self.tensor_extents())
        count = 0
        for shard in self.shard_files:
            with safe_open(str(shard), framework=_HEADER_FRAMEWORK, device="cpu") as reader:
                count += len(reader.keys())
        return count

    def tensor_extents(self) -> list[TensorExtent]:
        """Every tensor's bytes in the weight files, shard by shard in file order (for
        `ember.weights.parallel_load`); the headers are read once, at the first call."""
        from ember.weights.safetensors_layout import read_extents

        if self._extents is None:
            self._extents = [
                extent
                for shard in self.shard_files
                for extent in read_extents(shard, self.weight_files)
            ]
        return list(self._extents)

    def tensor_headers(self) -> list[TensorHeader]:
        """Every tensor's name, shape and file, from the safetensors headers."""
        return [
            TensorHeader(extent.name, extent.shape, extent.path, extent.name)
            for extent in self.tensor_extents()
        ]

    def iter_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every tensor of every shard; floating tensors are cast to `dtype`."""
        for shard in self.shard_files:
            if self.weight_files is not None:
                self.weight_files.wait(shard, 0, self._file_size(shard))
            try:
                with safe_open(str(shard), framework="pt", device="cpu") as reader:
                    tensor_names = reader.keys()  # the reader itself is not iterable
                    for tensor_name in tensor_names:
                        tensor = reader.get_tensor(tensor_name)
                        if tensor.is_floating_point() and tensor.dtype != dtype:
                            tensor = tensor.to(dtype)
                        yield tensor_name, tensor
            except (OSError, RuntimeError, SafetensorError) as exc:
                raise ValueError(f"{shard}: cannot read safetensors file: {exc}") from exc

    def __repr__(self) -> str:
        return f"HFDirCheckpoint({str(self.path)!r}, shards={len(self.shard_files)})"


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from `path`; any problem is a ValueError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: missing") from None
    except OSError as exc:
        raise ValueError(f"{path}: unreadable: {exc}") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON: {exc}") from exc
    if isinstance(value, dict):
        return value
    raise ValueError(f"{path}: expected a JSON object, found {type(value).__name__}")


def _read_optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.exists() else {}


def _find_weight_files(
    model_dir: Path, arriving: frozenset[str] = frozenset()
) -> tuple[list[Path], dict[str, set[str]]]:
    """The safetensors files to load, and for an indexed checkpoint which tensors each holds;
    the files named in ``arriving`` count as present though they may not be on disk yet."""

    def present(name: str) -> bool:
        return name in arriving or (model_dir / name).is_file()

    index_path = model_dir / WEIGHTS_INDEX_FILE
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: no weight_map")
        expected: dict[str, set[str]] = {}
        for tensor_name, shard_name in weight_map.items():
            expected.setdefault(shard_name, set()).add(tensor_name)
        shards = [model_dir / shard_name for shard_name in sorted(expected)]
        for shard in shards:
            if not present(shard.name):
                raise ValueError(f"{shard}: missing (listed in {index_path.name})")
        return shards, expected
    if present(SINGLE_WEIGHTS_FILE):
        return [model_dir / SINGLE_WEIGHTS_FILE], {}
    # Shards saved without their index still load: each tensor is named inside its file.
    names = {p.name for p in model_dir.glob("model-*.safetensors")}
    names |= {n for n in arriving if n.startswith("model-") and n.endswith(".safetensors")}
    if names:
        return [model_dir / name for name in sorted(names)], {}
    if any(p.suffix in PICKLED_WEIGHT_SUFFIXES for p in model_dir.iterdir()):
        raise ValueError(
            f"{model_dir}: only pickled weights (*.bin / *.pt) found; ember loads only "
            "safetensors (pickle files can execute code). Convert the checkpoint to safetensors."
        )
    raise ValueError(f"{model_dir}: no {SINGLE_WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} found")


def _check_shard(shard: Path, expected_names: Collection[str]) -> None:
    """Parse the header (cheap: no tensor data is read) and compare it with the index."""
    try:
        with safe_open(str(shard), framework=_HEADER_FRAMEWORK, device="cpu") as reader:
            names = set(reader.keys())
    except (OSError, RuntimeError, SafetensorError) as exc:
        raise ValueError(f"{shard}: truncated or corrupt safetensors file: {exc}") from exc
    _check_names(shard, names, expected_names)


def _check_arriving_shard(shard: Path, expected_names: Collection[str], files: WeightFiles) -> None:
    """`_check_shard` for a file that may still be arriving: its header, read once it is here."""
    from ember.weights.safetensors_layout import read_extents

    _check_names(shard, {extent.name for extent in read_extents(shard, files)}, expected_names)


def _check_names(shard: Path, names: set[str], expected_names: Collection[str]) -> None:
    missing = set(expected_names) - names
    if missing:
        raise ValueError(
            f"{shard}: lacks {len(missing)} tensor(s) the index places there, e.g. {min(missing)!r}"
        )


def _read_separate_chat_templates(model_dir: Path) -> str | list[dict[str, str]] | None:
    """chat_template.jinja (+ named extra templates) or chat_template.json, if present."""
    jinja_path = model_dir / CHAT_TEMPLATE_JINJA_FILE
    extra_dir = model_dir / EXTRA_CHAT_TEMPLATES_DIR
    if jinja_path.is_file():
        default = jinja_path.read_text(encoding="utf-8")
        extras = sorted(extra_dir.glob("*.jinja")) if extra_dir.is_dir() else []
        if not extras:
            return default
        named = [{"name": "default", "template": default}]
        named += [{"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extras]
        return named
    json_path = model_dir / CHAT_TEMPLATE_JSON_FILE
    if json_path.is_file():
        return read_json(json_path).get("chat_template")
    return None
