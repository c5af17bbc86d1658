"""FP8 products past the skinny GEMM: activations quantized per token, then cuBLASLt's FP8 GEMM.

Past decode sizes a product is compute-bound, and an FP8 weight pays where the tensor cores
multiply in FP8: each row (token) of ``x`` is quantized to float8 e4m3 with its own scale
(`quantize_rows_fp8`, the rule of `ember.layers.fp8.quantize_rows`), and ``torch._scaled_mm``
multiplies the two FP8 operands with the activations' row scales and the weight's column scales,
into bfloat16. No host sync: the pair runs inside CUDA graphs.

Where ``_scaled_mm`` cannot run (not a CUDA bf16 product, or a dimension not a multiple of 16,
its operands' alignment) the weight is dequantized and cuBLAS runs the product in the
activations' dtype, as the reference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ember.kernels.compile_ahead import launch
from ember.kernels.pdl import wait_for_producer
from ember.layers.fp8 import FP8_DTYPE, FP8_E4M3_MAX, MIN_ROW_SCALE, Fp8Weight, dense_weight

_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_MIN_SCALE = tl.constexpr(MIN_ROW_SCALE)
# Widest column block a program loads at once; longer rows take several.
_MAX_BLOCK_K = 2048
# What `_scaled_mm` asks of its operands' dimensions.
_SCALED_MM_ALIGNMENT = 16


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    stride_qm,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row: its largest magnitude (first pass), then the row divided by its
    scale, clamped and rounded to float8 e4m3 (second pass)."""
    wait_for_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    largest = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(largest, 0), _FP8_MAX), _MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k0 in tl.range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX)
        tl.store(q_ptr + row * stride_qm + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)


def quantize_rows_fp8(x: torch.Tensor, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` for ``x [M, K]`` (K contiguous): ``q`` float8 e4m3 ``[M, K]`` contiguous,
    ``scale`` float32 ``[M, 1]``, as `ember.layers.fp8.quantize_rows` computes them."""
    m, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("x's rows must be contiguous")
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block_k = min(triton.next_power_of_2(k), _MAX_BLOCK_K)
        launch(
            _quantize_rows_kernel,
            (m,),
            x,
            q,
            scale,
            k,
            x.stride(0),
            q.stride(0),
            BLOCK_K=block_k,
            PDL=pdl,
            launch_pdl=pdl,
        )
    return q, scale


def takes_scaled_mm(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether ``x @ weight.T`` can run as ``torch._scaled_mm``: a CUDA bfloat16 product whose
    dimensions are multiples of 16."""
    n, k = weight.weight.shape
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and k % _SCALED_MM_ALIGNMENT == 0
        and n % _SCALED_MM_ALIGNMENT == 0
        and weight.weight.is_contiguous()
    )


def fp8_linear(
    x: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in ``x``'s dtype: ``x`` quantized per row and the FP8 GEMM where
    `takes_scaled_mm`, else the weight dequantized and a GEMM in ``x``'s dtype."""
    if not takes_scaled_mm(x, weight):
        return F.linear(x, dense_weight(weight, x.dtype), bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    q, row_scale = quantize_rows_fp8(x, pdl=pdl)
    out = torch._scaled_mm(
        q,
        weight.weight.t(),  # column-major [K, N], as the second operand must be
        scale_a=row_scale,
        scale_b=weight.scale.view(1, -1),
        out_dtype=x.dtype,
    )
    if bias is not None:
        out += bias
    return out
