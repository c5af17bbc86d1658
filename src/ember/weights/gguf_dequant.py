"""Turning GGUF tensor bytes into float32 tensors.

The common types are decoded with vectorised torch ops (multi-threaded, ~10x faster than
`gguf.quants.dequantize` on a small CPU); every other type falls back to `gguf.quants`. The torch
paths do the same float32 arithmetic in the same order as `gguf.quants`, so results are identical.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize


def dequantize(
    raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Decode `raw` (uint8, the tensor's bytes) of `ggml_type` into a float32 tensor of `shape`.

    Plain float types come back as their exact float32 values.
    """
    decode = _TORCH_DECODERS.get(ggml_type)
    if decode is not None:
        _, block_bytes = GGML_QUANT_SIZES[ggml_type]
        return decode(raw.view(-1, block_bytes)).reshape(shape)
    values = gguf_dequantize(raw.numpy(), ggml_type)  # raises NotImplementedError if unknown
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _half_scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 scale stored at byte `start` of each block, as a float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _low_then_high_nibbles(packed: torch.Tensor) -> torch.Tensor:
    # Block element j < 16 is the low nibble of byte j, element j >= 16 the high nibble of j-16.
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32).clone()


def _f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # Block: f16 scale d, then 32 int8 values; x = d * q.
    quants = blocks[:, 2:].contiguous().view(torch.int8).float()
    return quants * _half_scale(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # Block: f16 scale d, then 16 bytes of 4-bit values; x = d * (q - 8).
    quants = _low_then_high_nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _half_scale(blocks, 0) * quants.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # Block: f16 scale d, f16 minimum m, then 16 bytes of 4-bit values; x = d * q + m.
    quants = _low_then_high_nibbles(blocks[:, 4:]).float()
    return _half_scale(blocks, 0) * quants + _half_scale(blocks, 2)


_TORCH_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.F32: _f32,
    GGMLQuantizationType.F16: _f16,
    GGMLQuantizationType.BF16: _bf16,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
}
