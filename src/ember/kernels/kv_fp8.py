"""An FP8 KV cache in the Triton kernels: what a write stores and what a launch passes.

A float8 e4m3 cache stores ``clamp(x / scale, -448, 448)`` with one scale per layer for keys
and one for values (docs/CONTRACTS.md, "FP8 KV cache"), as `ember.layers.reference_ops` does.
The kernels that write the cache quantize through `to_cache`; the attention kernel reads the
stored values widened to the queries' dtype and folds the scales into the softmax scale and the
output instead of multiplying every loaded element. A cache of the model's dtype compiles none
of this: ``KV_FP8`` is a constexpr, and its scales are passed as None (constexprs too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.layers.reference_ops import FP8_E4M3_MAX, FP8_KV_DTYPE

_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def to_cache(x, scale, value_ty: tl.constexpr, cache_ty: tl.constexpr, KV_FP8: tl.constexpr):
    """fp32 ``x`` as the cache stores it. FP8: rounded to ``value_ty`` (the model's dtype, as
    the reference's k and v are) and quantized, ``clamp(x / scale, -448, 448)`` with a
    correctly rounded division; otherwise cast to ``cache_ty`` once."""
    if KV_FP8:
        scaled = tl.math.div_rn(x.to(value_ty).to(tl.float32), scale)
        return tl.minimum(tl.maximum(scaled, -_FP8_MAX), _FP8_MAX).to(cache_ty)
    return x.to(cache_ty)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def kv_scale_args(cache: torch.Tensor, kv_scales: tuple[float, float]) -> tuple:
    """A kernel's ``(k_scale, v_scale)`` arguments: the floats for an FP8 ``cache``, else None
    (a constexpr: no argument in the compiled kernel)."""
    if not is_fp8_cache(cache):
        return None, None
    k_scale, v_scale = kv_scales
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"kv_scales must be positive, got {kv_scales}")
    return float(k_scale), float(v_scale)
