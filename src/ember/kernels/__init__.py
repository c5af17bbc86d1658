"""Triton kernels for the GPU fast path, one concern per module.

Each op has a plain-PyTorch twin with the same signature in ``ember.layers.reference_ops``; the
kernels are tested against those on a CPU under ``TRITON_INTERPRET=1``.
"""

from ember.kernels.activation import silu_and_mul
from ember.kernels.argmax import greedy_argmax
from ember.kernels.attention_step import rope_and_attention
from ember.kernels.linear import gate_up_silu, linear, linear_add, linear_parts
from ember.kernels.paged_attention import choose_num_kv_splits, paged_attention
from ember.kernels.rmsnorm import (
    add_and_sum_squares,
    add_parts_rms_norm,
    fused_add_rms_norm,
    rms_norm,
)
from ember.kernels.rope_cache_write import rope_and_cache_write
from ember.kernels.sampling import sample

__all__ = [
    "add_and_sum_squares",
    "add_parts_rms_norm",
    "choose_num_kv_splits",
    "fused_add_rms_norm",
    "gate_up_silu",
    "greedy_argmax",
    "linear",
    "linear_add",
    "linear_parts",
    "paged_attention",
    "rms_norm",
    "rope_and_attention",
    "rope_and_cache_write",
    "sample",
    "silu_and_mul",
]
