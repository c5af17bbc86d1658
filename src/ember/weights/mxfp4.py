"""MXFP4 weights (OCP microscaling FP4), as gpt-oss's published checkpoints store their experts.

A tensor ``W`` [..., rows, cols] is stored as two: ``*_blocks`` uint8 [..., rows, cols / 32, 16],
each byte two FP4 (e2m1) codes, the low nibble the even column; and ``*_scales`` uint8
[..., rows, cols / 32], one power-of-two exponent (e8m0, bias 127) per 32 columns. A value is
``E2M1[code] * 2 ** (scale - 127)``. ember keeps gpt-oss's experts packed in this form
(`ember.layers.mxfp4`) and `dequantize_mxfp4` widens them (the reference ops, expert by expert;
or a whole model at load); every value of the format is exact in bfloat16 (a 2-bit mantissa
times a power of two).
`quantize_mxfp4` writes the format (for checkpoints made by `ember bench make-model` and tests).
"""

from __future__ import annotations

import torch

BLOCK_COLUMNS = 32  # columns sharing one scale
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; 8-15 are their negatives
_SCALE_BIAS = 127
_E2M1_MAX = 6.0
# Rows decoded at once: bounds the int64 index and float32 temporaries to tens of MB.
_ROWS_PER_CHUNK = 1 << 14


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``W`` [..., rows, cols] in ``dtype`` from its MXFP4 ``blocks`` and ``scales``.
    ValueError when their shapes do not pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not pair with scales {tuple(scales.shape)} "
            "(expected blocks [..., groups, 16] and scales [..., groups])"
        )
    *lead, groups, _ = blocks.shape
    packed = blocks.reshape(-1, groups * 16)
    exponents = scales.reshape(-1, groups).to(torch.int32) - _SCALE_BIAS
    codes = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    table = torch.cat((codes, -codes))
    out = torch.empty(packed.shape[0], groups * BLOCK_COLUMNS, dtype=dtype, device=blocks.device)
    for start in range(0, packed.shape[0], _ROWS_PER_CHUNK):
        rows = packed[start : start + _ROWS_PER_CHUNK]
        values = torch.stack((table[(rows & 0x0F).long()], table[(rows >> 4).long()]), dim=-1)
        values = values.view(rows.shape[0], groups, BLOCK_COLUMNS)
        scaled = torch.ldexp(values, exponents[start : start + rows.shape[0], :, None])
        out[start : start + rows.shape[0]] = scaled.view(rows.shape[0], -1).to(dtype)
    return out.view(*lead, groups * BLOCK_COLUMNS)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of ``weight`` [..., rows, cols] (cols a multiple of 32): each group
    of 32 columns scaled by the smallest power of two that brings its largest magnitude within
    6, then every value rounded to the nearest FP4 (e2m1) value, ties to the smaller
    magnitude."""
    *lead, rows, cols = weight.shape
    if cols % BLOCK_COLUMNS:
        raise ValueError(f"MXFP4 needs a multiple of {BLOCK_COLUMNS} columns, not {cols}")
    groups = weight.float().reshape(*lead, rows, cols // BLOCK_COLUMNS, BLOCK_COLUMNS)
    largest = groups.abs().amax(dim=-1)
    exponents = torch.ceil(torch.log2(largest / _E2M1_MAX)).nan_to_num(0, posinf=0, neginf=0)
    # log2 may round: make sure the largest value fits, then keep the byte's range.
    exponents += (largest > _E2M1_MAX * torch.exp2(exponents)).float()
    exponents = exponents.clamp(-_SCALE_BIAS, _SCALE_BIAS)
    scaled = groups / torch.exp2(exponents)[..., None]
    # The nearest magnitude's code: how many midpoints between codes lie below (a tie, on a
    # midpoint, counts it not: the smaller magnitude).
    magnitudes = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=weight.device)
    nearest = torch.bucketize(scaled.abs().contiguous(), (magnitudes[1:] + magnitudes[:-1]) / 2)
    codes = (nearest + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponents + _SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
