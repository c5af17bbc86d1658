"""SiLU-and-mul, the gated MLP activation: ``silu(x[:, :I]) * x[:, I:]``.

Hugging Face's ``act_fn(gate) * up`` rounds the SiLU output to the model dtype before the
product, so the kernel does the same (both in fp32, each rounded once). With a deferred RMSNorm
(``row_norm``: the norm's weight folded into gate/up, see `ember.layers.row_norm`) gate and up
are first scaled by their row's ``1/rms`` and rounded, as the normalised row's GEMM would give.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.compile_ahead import launch
from ember.kernels.pdl import wait_for_producer
from ember.kernels.row_norm import check_row_norm, inv_rms_of, load_row_parts, row_norm_args
from ember.layers.row_norm import RowNorm

# 1024 bf16 elements per program: 16-byte loads for 4 warps, and enough programs per row.
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    parts_ptr,
    inter,
    stride_x,
    stride_o,
    num_parts,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    ROW_NORM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    if ROW_NORM:  # issued with the loads below, reduced after them
        row_parts = load_row_parts(parts_ptr, row, num_parts, BLOCK_P)
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if ROW_NORM:
        inv_rms = inv_rms_of(row_parts, hidden, eps)
        gate = (gate * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
        up = (up * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols,
        silu_mul_rounded(gate, up, out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` in ``dtype`` from fp32 operands: SiLU rounded to ``dtype`` before the
    product, as Hugging Face's ``act_fn(gate) * up`` (`skinny_gemm_silu` shares it)."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


def silu_and_mul(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    row_norm: RowNorm | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``x [T, 2I]`` -> ``[T, I]`` (``out`` if given); rows may be strided, columns contiguous.
    ``row_norm``: scale each row of ``x`` by its ``1/rms`` first. ``pdl``: launch with
    programmatic dependent launch (`ember.kernels.pdl`)."""
    num_tokens, width = x.shape
    inter = width // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("the feature dim must be contiguous")
    check_row_norm(row_norm, num_tokens)
    if num_tokens == 0:
        return out
    (parts, num_parts, hidden, eps), block_p = row_norm_args(row_norm, x)
    launch(
        _silu_and_mul_kernel,
        (num_tokens, triton.cdiv(inter, _BLOCK)),
        x,
        out,
        parts,
        inter,
        x.stride(0),
        out.stride(0),
        num_parts,
        hidden,
        eps,
        BLOCK=_BLOCK,
        ROW_NORM=row_norm is not None,
        BLOCK_P=block_p,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out
