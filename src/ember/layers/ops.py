"""The compute primitives a model calls, as one swappable object per model instance.

`reference_ops()` is plain PyTorch (CPU, and the correctness oracle on a GPU);
`triton_ops()` is the Triton fast path. Both take and return the same tensors, so the model code
is written once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ops:
    name: str
    # (x, weight, bias) -> x @ weight.T + bias, as F.linear.
    linear: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    # (x, residual, weight, eps) -> None; residual += x, x = rms_norm(residual) in place.
    fused_add_rms_norm: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]
    rope_and_cache_write: Callable[..., None]
    paged_attention: Callable[..., None]
    sample: Callable[..., torch.Tensor]
    # Whether a forward pass can be captured in a CUDA graph: the reference ops pick rows with
    # boolean masks and read lengths back to the host, which capture forbids.
    capturable: bool


def reference_ops() -> Ops:
    from ember.layers import reference_ops as ref

    return Ops(
        name="reference",
        linear=torch.nn.functional.linear,
        rms_norm=ref.rms_norm_reference,
        fused_add_rms_norm=ref.fused_add_rms_norm_reference,
        silu_and_mul=ref.silu_and_mul_reference,
        rope_and_cache_write=ref.rope_and_cache_write_reference,
        paged_attention=ref.paged_attention_reference,
        sample=ref.sample_reference,
        capturable=False,
    )


def triton_ops() -> Ops:
    from ember import kernels

    return Ops(
        name="triton",
        linear=kernels.linear,
        rms_norm=kernels.rms_norm,
        fused_add_rms_norm=kernels.fused_add_rms_norm,
        silu_and_mul=kernels.silu_and_mul,
        rope_and_cache_write=kernels.rope_and_cache_write,
        paged_attention=kernels.paged_attention,
        sample=kernels.sample,
        capturable=True,
    )


def select_ops(device: torch.device, backend: str = "auto") -> Ops:
    """Triton on CUDA unless asked otherwise; the reference everywhere else."""
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return reference_ops()
    if backend in ("auto", "triton"):
        return triton_ops()
    raise ValueError(f"unknown attention backend {backend!r}; choose auto, triton or reference")
