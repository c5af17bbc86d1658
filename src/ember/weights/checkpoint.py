"""What every checkpoint source gives the engine, whatever its format or location."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorHeader:
    """One checkpoint tensor as its file's header describes it, before any byte is read."""

    name: str  # the Hugging Face name
    shape: tuple[int, ...]  # as `iter_tensors` yields it
    path: Path  # the file that holds it
    stored_name: str  # its name in that file (a GGUF file renames every tensor)

    def describe(self) -> str:
        """``file: tensor 'name'``, with the file's own name for it where that differs."""
        stored = f" ({self.stored_name} in the file)" if self.stored_name != self.name else ""
        return f"{self.path}: tensor {self.name!r}{stored}"


class Checkpoint(Protocol):
    """A model on local storage: its config, its tensors under Hugging Face names, its tokenizer.

    Implementations: `HFDirCheckpoint` (a model directory or an HF cache snapshot) and
    `GGUFCheckpoint` (a single GGUF file).
    """

    @property
    def name(self) -> str:
        """A human-readable name (directory or file name) used in logs and errors."""

    @property
    def hf_config(self) -> dict[str, Any]:
        """The config.json-equivalent dictionary."""

    @property
    def tokenizer(self) -> Any:
        """A `tokenizers.Tokenizer` instance."""

    @property
    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json-equivalent: chat_template, bos_token, eos_token, add_bos_token."""

    @property
    def generation_config(self) -> dict[str, Any]:
        """generation_config.json-equivalent (eos_token_id, bos_token_id, ...); may be empty."""

    @property
    def num_tensors(self) -> int:
        """How many tensors `iter_tensors` yields (cheap: read from headers)."""

    def tensor_headers(self) -> list[TensorHeader]:
        """Every tensor `iter_tensors` yields, from the headers alone (no tensor byte is read)."""

    def iter_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, tensor) pairs on the CPU, cast to `dtype` (floating tensors only)."""
