"""What every checkpoint source gives the engine, whatever its format or location."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


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

    def iter_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, tensor) pairs on the CPU, cast to `dtype` (floating tensors only)."""
