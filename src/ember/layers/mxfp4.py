"""MXFP4 expert weights as the ops take them: packed, two FP4 (e2m1) values a byte, one power of
two (e8m0) a group of 32 values along K (the format: `ember.weights.mxfp4`).

A mixture of experts' stacked weight ``[E, N, K]`` is an `Mxfp4Weight`: ``blocks`` uint8
``[E, N, K / 32, 16]`` (byte j of a row: values 2j in its low nibble, 2j + 1 in its high one)
and ``scales`` uint8 ``[E, N, K / 32]``, as gpt-oss's checkpoints store them (docs/CONTRACTS.md,
"MXFP4 experts"). Rows are the ops' (w13: gate rows, then up rows), contiguous: the fused MoE's
tiles read a row's bytes along K, and the reference dequantizes the experts it runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ember.weights.mxfp4 import BLOCK_COLUMNS, dequantize_mxfp4

BLOCK_BYTES = BLOCK_COLUMNS // 2  # the bytes of one scale's group


class Mxfp4Weight(NamedTuple):
    """Stacked MXFP4 experts: ``blocks`` uint8 ``[E, N, K / 32, 16]``, ``scales`` uint8
    ``[E, N, K / 32]``, standing for ``[E, N, K]``."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for: ``[E, N, K]``."""
        *lead, groups, _ = self.blocks.shape
        return (*lead, groups * BLOCK_COLUMNS)

    def expert(self, index: int) -> Mxfp4Weight:
        return Mxfp4Weight(self.blocks[index], self.scales[index])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (every value of the format is exact in bf16 and fp32)."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype)


def mxfp4_parameters(experts: int, rows: int, cols: int) -> tuple[nn.Parameter, nn.Parameter]:
    """Empty ``(blocks, scales)`` parameters of ``experts`` stacked ``[rows, cols]`` weights;
    ValueError unless ``cols`` is a multiple of 32."""
    if cols % BLOCK_COLUMNS:
        raise ValueError(f"MXFP4 weights need a multiple of {BLOCK_COLUMNS} columns, not {cols}")
    groups = cols // BLOCK_COLUMNS
    blocks = torch.empty(experts, rows, groups, BLOCK_BYTES, dtype=torch.uint8)
    scales = torch.empty(experts, rows, groups, dtype=torch.uint8)
    return nn.Parameter(blocks, requires_grad=False), nn.Parameter(scales, requires_grad=False)


def held_mxfp4_weights(model: nn.Module) -> list[Mxfp4Weight]:
    """Every MXFP4 weight in ``model``: the ``mxfp4_weights()`` of each module that holds some
    (a mixture of experts' stacked experts), as parameters."""
    held = []
    for module in model.modules():
        mxfp4_weights = getattr(module, "mxfp4_weights", None)
        if mxfp4_weights is not None:
            held += mxfp4_weights()
    return held
