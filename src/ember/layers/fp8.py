"""float8 e4m3 as ember stores it: the format's range, and the FP8 weights the ops take.

An FP8 linear layer's operand is an `Fp8Weight`: ``weight`` float8 e4m3 ``[out, in]`` and
``scale`` float32 ``[out]``, one per output row, standing for ``weight.float() * scale[:, None]``
(docs/CONTRACTS.md, "FP8 weights"). Every op that takes a weight takes one in its place; a
mixture of experts' stacked weights are one too, ``[E, out, in]`` with ``[E, out]`` scales. A row
(of a weight at load, or of activations before an FP8 product) is quantized by `quantize_rows`:
its scale maps its largest magnitude onto 448, the format's largest finite value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # float8 e4m3fn's largest finite value
# The smallest scale a row gets: a row of zeros (a padding token) quantizes to zeros, not NaN.
MIN_ROW_SCALE = 1e-12
# Rows quantized at once at load: the float32 copy of a block stays small beside the KV cache,
# which holds the GPU's free memory by then.
_QUANTIZE_ROWS = 2048


class Fp8Weight(NamedTuple):
    """An FP8 linear weight: ``weight`` float8 e4m3 ``[out, in]``, ``scale`` float32 ``[out]``
    (stacked experts: ``[E, out, in]`` and ``[E, out]``)."""

    weight: torch.Tensor
    scale: torch.Tensor


def held_fp8_weights(model: nn.Module) -> list[Fp8Weight]:
    """Every FP8 weight in ``model``, with its scales: the ``fp8_weights()`` of each module that
    holds some (a projection, a mixture of experts' stacked experts), as parameters."""
    held = []
    for module in model.modules():
        fp8_weights = getattr(module, "fp8_weights", None)
        if fp8_weights is not None:
            held += fp8_weights()
    return held


def dense_weight(weight: torch.Tensor | Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` as a tensor of ``dtype``: an `Fp8Weight` dequantized (``weight * scale`` in
    float32, rounded once), a tensor as it is."""
    if not isinstance(weight, Fp8Weight):
        return weight
    return (weight.weight.float() * weight.scale[..., None]).to(dtype)


def quantize_rows(
    x: torch.Tensor, row_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` for ``x [M, K]``: ``scale`` float32 ``[M, 1]`` maps each row's largest
    magnitude (``row_amax [M]`` where given: a whole row's, of which ``x`` holds a slice) onto
    448 (at least `MIN_ROW_SCALE`), ``q = clamp(x / scale, -448, 448)`` in float8 e4m3 (float32
    division, rounded to nearest even)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True) if row_amax is None else row_amax[:, None]
    scale = (amax / FP8_E4M3_MAX).clamp(min=MIN_ROW_SCALE)
    return (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE), scale


def fp8_weight_of(weight: torch.Tensor) -> Fp8Weight:
    """``weight [out, in]`` quantized per row (`quantize_rows`) as an `Fp8Weight`."""
    q, scale = quantize_rows(weight)
    return Fp8Weight(q, scale[:, 0].contiguous())


@torch.no_grad()
def quantize_rows_into(
    source: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    column_scale: torch.Tensor | None = None,
    whole_row_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Quantize ``source [..., N, K]`` (any float dtype) into ``weight`` (float8, of its shape)
    and ``scale`` (float32 ``[..., N]``) by `quantize_rows`, a block of rows at a time (stacked
    experts' rows as one matrix's). ``column_scale`` ``[K]``: ``source diag(column_scale)`` is
    quantized (a folded RMSNorm weight), the product taken in float32 and rounded only by the
    quantization. ``whole_row_amax``: ``source`` is a slice of the columns of whole rows (a
    tensor-parallel rank's, of a row-parallel weight), and this maps its rows' largest
    magnitudes ``[N]`` to the whole rows' (over the ranks), so the scales are the whole
    rows'."""
    source = source.reshape(-1, source.shape[-1])
    weight, scale = weight.view(-1, weight.shape[-1]), scale.view(-1)
    amax = None
    if whole_row_amax is not None:
        amax = torch.cat(
            [
                _scaled_rows(source[first : first + _QUANTIZE_ROWS], column_scale).abs().amax(1)
                for first in range(0, source.shape[0], _QUANTIZE_ROWS)
            ]
        )
        amax = whole_row_amax(amax)
    for first in range(0, source.shape[0], _QUANTIZE_ROWS):
        rows = _scaled_rows(source[first : first + _QUANTIZE_ROWS], column_scale)
        block_amax = None if amax is None else amax[first : first + rows.shape[0]]
        q, row_scale = quantize_rows(rows, block_amax)
        weight[first : first + rows.shape[0]].copy_(q)
        scale[first : first + rows.shape[0]].copy_(row_scale[:, 0])


def _scaled_rows(rows: torch.Tensor, column_scale: torch.Tensor | None) -> torch.Tensor:
    """``rows`` in float32, times ``column_scale`` (per column) where given."""
    rows = rows.float()
    if column_scale is not None:
        rows = rows * column_scale.float()[None, :]
    return rows
