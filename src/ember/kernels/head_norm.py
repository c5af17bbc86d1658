"""Qwen3's q/k RMSNorm (`ember.layers.qk_norm.QkNorm`) inside the kernels that rotate q and k.

Rounded as `ember.kernels.rmsnorm` rounds (and `reference_ops.rms_norm_reference`): each head's
``1/rms`` in fp32 with a correctly rounded division and square root, the normalised head rounded
to the dtype, times the weight (as the dtype holds it), rounded again; the rotation then reads
that, as it reads the separate norm's output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ember.layers.qk_norm import QkNorm


@triton.jit
def head_inv_rms(sum_of_squares, eps, HEAD_DIM: tl.constexpr):
    """``1 / sqrt(sum_of_squares / HEAD_DIM + eps)`` of fp32 sums, as the RMSNorm kernel."""
    mean_square = tl.math.div_rn(sum_of_squares, HEAD_DIM)
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_square + eps))


@triton.jit
def rms_norm_heads(x, inv_rms, weight_ptr, dims, dtype: tl.constexpr):
    """fp32 ``x`` (values of ``dtype``; rows of heads or one head, over ``dims``) times its
    head's ``inv_rms`` (broadcast), rounded, times the weight at ``dims`` (any order: a
    rotation's partners), rounded: the separate RMSNorm's output, as fp32."""
    weight = tl.load(weight_ptr + dims).to(dtype).to(tl.float32)
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    return (normed * weight).to(dtype).to(tl.float32)


def qk_norm_args(qk_norm: QkNorm | None, head_dim: int, like) -> tuple:
    """A kernel's ``(q_norm_ptr, k_norm_ptr, qk_norm_eps)`` for ``qk_norm`` (``like`` stands in
    for the pointers when there is none)."""
    if qk_norm is None:
        return like, like, 0.0
    qk_norm.check(head_dim)
    return qk_norm.q_weight, qk_norm.k_weight, float(qk_norm.eps)
