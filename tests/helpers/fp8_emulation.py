"""The reference path with its activations rounded to FP8 as the Triton path's ``_scaled_mm``
rounds them (per row, `ember.layers.fp8.quantize_rows`): how the FP8 GPU tests tell the
activations' rounding from a wrong product."""

from __future__ import annotations

import contextlib

import torch

from ember.layers import reference_ops
from ember.layers.fp8 import Fp8Weight, quantize_rows


@contextlib.contextmanager
def rounded_activations(monkeypatch):
    """Within: every reference product by an FP8 weight first rounds ``x`` to FP8 per row (and
    back to its dtype), as the activations the FP8 GEMM multiplies."""
    plain = reference_ops.linear_reference

    def linear(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
        if isinstance(weight, Fp8Weight):
            rows = x.reshape(-1, x.shape[-1])
            q, scale = quantize_rows(rows)
            x = (q.float() * scale).to(x.dtype).reshape(x.shape)
        return plain(x, weight, bias)

    with monkeypatch.context() as patch:
        patch.setattr(reference_ops, "linear_reference", linear)
        yield
