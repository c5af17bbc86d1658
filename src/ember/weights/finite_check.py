"""Which loaded weight, if any, holds a NaN or an infinity.

A damaged file (garbage in a GGUF's tensor data, a NaN written into a safetensors tensor) loads
without complaint and then serves NaN logits; the loader asks this once the weights have landed.
One min/max reduction per tensor, on its own device: a NaN propagates through both and an
infinity is one of them, and no temporary the size of the tensor is made (`torch.isfinite`
would allocate a bool copy, ~0.5 GB for an 8B model's embedding, while the KV cache holds the
free memory). The results come back in one transfer, so the check costs one read of the weights
at memory bandwidth and one synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first of ``tensors`` (name, floating tensor) that holds a NaN or an
    infinity, or None if every value is finite."""
    names: list[str] = []
    extremes: list[torch.Tensor] = []
    for name, tensor in tensors:
        if tensor.numel():  # the reduction refuses an empty tensor, which holds nothing bad
            names.append(name)
            extremes.extend(torch.aminmax(tensor))
    if not names:
        return None
    finite = torch.isfinite(torch.stack(extremes).view(-1, 2)).all(dim=1).tolist()
    return next((name for name, ok in zip(names, finite, strict=True) if not ok), None)
