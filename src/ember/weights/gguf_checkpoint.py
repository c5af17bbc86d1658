"""A GGUF model file seen as a Hugging Face checkpoint: config, tensors, tokenizer, template."""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np
from tokenizers import Tokenizer

from ember.tokenizer.gguf_tokenizer import tokenizer_config_from_gguf, tokenizer_from_gguf
from ember.weights.checkpoint import TensorHeader
from ember.weights.gguf_config import (
    generation_config_from_gguf,
    gguf_architecture,
    hf_config_from_gguf,
)
from ember.weights.gguf_file import GGUFFile, GGUFTensorInfo
from ember.weights.gguf_names import (
    DERIVED_TENSORS,
    hf_tensor_name,
    rope_permuted_heads,
    undo_rope_permutation,
)

if TYPE_CHECKING:
    import torch

_ROPE_FREQS = "rope_freqs.weight"


class GGUFCheckpoint:
    """A memory-mapped GGUF file exposing HF-equivalent config dicts and HF-named tensors.

    Raises ValueError naming the file when it is truncated, corrupt, or of an unsupported
    architecture. Quantized tensors stay packed in the mapping until `iter_tensors` decodes them.
    """

    def __init__(self, path: os.PathLike | str):
        self.path = Path(path)
        self._file = GGUFFile(self.path)
        try:
            self.architecture = gguf_architecture(self.metadata, str(self.path))
            self._hf_names = self._map_tensor_names()
            self.hf_config: dict[str, Any] = hf_config_from_gguf(
                self.metadata,
                self._file.tensors.keys(),
                vocab_size=self._file.tensors["token_embd.weight"].shape[0],
                rope_divisors=self._rope_divisors(),
                path=str(self.path),
            )
        except BaseException:
            self._file.close()
            raise

    @property
    def name(self) -> str:
        """The file name, for logs and errors."""
        return self.path.name

    @property
    def metadata(self) -> dict[str, Any]:
        """The raw GGUF metadata (llama.cpp key names)."""
        return self._file.metadata

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The HF `tokenizers.Tokenizer` rebuilt from the file's vocabulary."""
        try:
            return tokenizer_from_gguf(self.metadata)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{self.path}: cannot build the tokenizer: {exc}") from exc

    @cached_property
    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json equivalent: chat_template, bos/eos tokens, add_bos_token."""
        return tokenizer_config_from_gguf(self.metadata)

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        """generation_config.json equivalent: eos_token_id (int or list) and bos_token_id."""
        return generation_config_from_gguf(self.metadata)

    @property
    def num_tensors(self) -> int:
        """How many tensors `iter_tensors` yields (for progress bars)."""
        return len(self._hf_names)

    def tensor_headers(self) -> list[TensorHeader]:
        """Every tensor `iter_tensors` yields, with its HF name and shape, from the tensor table
        (a quantized tensor's shape is that of its decoded values)."""
        return [
            TensorHeader(hf_name, self._file.tensors[gguf_name].shape, self.path, gguf_name)
            for gguf_name, hf_name in self._hf_names.items()
        ]

    def iter_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) in HF layout, dequantized to `dtype` (None: float32), one
        tensor at a time.

        Tied checkpoints yield no `lm_head.weight` (see `hf_config["tie_word_embeddings"]`).
        """
        # torch is imported here, not at module level: the front end opens GGUF files for their
        # metadata and tokenizer only, and must not pay for importing torch.
        import torch

        if dtype is None:
            dtype = torch.float32
        for gguf_name, hf_name in self._hf_names.items():
            info = self._file.tensors[gguf_name]
            tensor = self._decode(info)
            heads = rope_permuted_heads(
                self.architecture,
                hf_name,
                self.hf_config["num_attention_heads"],
                self.hf_config["num_key_value_heads"],
            )
            if heads is not None:
                tensor = undo_rope_permutation(tensor, heads)
            yield hf_name, tensor.to(dtype)

    def close(self) -> None:
        """Release the file mapping; tensors already yielded stay valid (they own their memory)."""
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _decode(self, info: GGUFTensorInfo) -> torch.Tensor:
        from ember.weights.gguf_dequant import dequantize  # imports torch

        try:
            return dequantize(self._file.raw(info), info.ggml_type, info.shape)
        except NotImplementedError as exc:
            raise ValueError(
                f"{self.path}: tensor {info.name!r} has unsupported type {info.ggml_type.name}"
            ) from exc

    def _map_tensor_names(self) -> dict[str, str]:
        names = {name: hf_tensor_name(name) for name in self._file.tensors}
        unknown = [n for n, hf in names.items() if hf is None and n not in DERIVED_TENSORS]
        if unknown:
            raise ValueError(f"{self.path}: tensors with no HF equivalent: {unknown[:5]}")
        if "token_embd.weight" not in names:
            raise ValueError(f"{self.path}: no token_embd.weight tensor")
        return {name: hf for name, hf in names.items() if hf is not None}

    def _rope_divisors(self) -> np.ndarray | None:
        info = self._file.tensors.get(_ROPE_FREQS)
        return None if info is None else self._decode(info).numpy()
