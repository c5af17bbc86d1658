"""Which loaded weight, if any, holds a NaN or an infinity.

A damaged file (garbage in a GGUF's tensor data, a NaN written into a safetensors tensor) loads
without complaint and then serves NaN logits; the loader asks this once the weights have landed.
One min/max reduction per tensor, on its own device: a NaN propagates through both and an
infinity is one of them, and no temporary the size of the tensor is made (`torch.isfinite`
would allocate a bool copy, ~0.5 GB for an 8B model's embedding, while the KV cache holds the
free memory). The results come back in one transfer, so the check costs one read of the weights
at memory bandwidth and one synchronisation.

A float8 e4m3 tensor (FP8 weights) holds no infinity, and its NaN is the bit pattern with every
exponent and mantissa bit set: those tensors are checked a block of rows at a time on their bits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_FP8_DTYPE = torch.float8_e4m3fn
_FP8_NAN_BITS = 0x7F  # sign bit aside, e4m3fn's one NaN
# Rows of an FP8 tensor whose bits are masked at once (a bool-sized temporary per block).
_FP8_ROWS = 2048


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first of ``tensors`` (name, floating tensor) that holds a NaN or an
    infinity, or None if every value is finite."""
    names: list[str] = []
    extremes: list[torch.Tensor] = []
    for name, tensor in tensors:
        if not tensor.numel():  # the reduction refuses an empty tensor, which holds nothing bad
            continue
        names.append(name)
        if tensor.dtype == _FP8_DTYPE:
            extremes.extend([_fp8_nan_marker(tensor)] * 2)
        else:
            extremes.extend(torch.aminmax(tensor))
    if not names:
        return None
    finite = torch.isfinite(torch.stack(extremes).view(-1, 2)).all(dim=1).tolist()
    return next((name for name, ok in zip(names, finite, strict=True) if not ok), None)


def _fp8_nan_marker(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 scalar on ``tensor``'s device: NaN if the float8 e4m3 ``tensor`` holds a NaN,
    else 0."""
    bits = tensor.reshape(tensor.shape[0] if tensor.dim() else 1, -1).view(torch.uint8)
    largest = torch.stack(
        [(block & _FP8_NAN_BITS).amax() for block in bits.split(_FP8_ROWS)]
    ).amax()
    return torch.where(largest == _FP8_NAN_BITS, float("nan"), 0.0)
