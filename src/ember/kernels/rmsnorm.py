"""RMSNorm, and residual-add fused with RMSNorm, with Hugging Face's cast order.

HF ``LlamaRMSNorm``: normalise in fp32, cast to the input dtype, then multiply by the weight
(a product rounded to the dtype). The fused op also rounds ``residual + x`` to the dtype before
normalising it, as HF's decoder layer adds in the model dtype.

`add_and_sum_squares` is the residual add without the norm: it leaves each row's sum of squares
for a deferred norm (`ember.layers.row_norm`), where the norm's weight sits in the next
projection.

`add_parts_rms_norm` is the fused op for a product left as split-K partial sums
(`ember.kernels.linear.LinearRouter.linear_parts`): it sums the float32 parts, rounds the sum to the
dtype (what the product's own reduce would have stored), then adds and normalises, so the
split-K reduce needs no kernel of its own.

A program normalises ``ROWS`` rows at once so that short rows (Qwen3's per-head q/k norm,
``head_dim`` wide) still give each program a few KiB of work; long rows (hidden size) get one
program each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.compile_ahead import launch
from ember.kernels.pdl import wait_for_producer

# Elements a program handles per launch: rows of hidden-size width get one program each.
_ELEMENTS_PER_PROGRAM = 2048


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    inner_rows,
    stride_x_outer,
    stride_x_inner,
    stride_x_part,
    stride_r_row,
    stride_o_outer,
    stride_o_inner,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SUM_SQUARES_ONLY: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows are addressed as (row // inner_rows, row % inner_rows) so 3-D strided views work.
    ``SUM_SQUARES_ONLY``: store each row's sum of squares to ``out_ptr[row]`` (float32), no
    normalised row. ``NUM_PARTS`` > 0: ``x`` is that many float32 partial sums
    ``stride_x_part`` apart, summed in order and rounded to the residual's dtype."""
    wait_for_producer(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols < HIDDEN)[None, :]
    outer = (rows // inner_rows).to(tl.int64)
    inner = rows % inner_rows
    x_offsets = (outer * stride_x_outer + inner * stride_x_inner)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0)
    if NUM_PARTS > 0:
        for part in tl.static_range(1, NUM_PARTS):
            x += tl.load(x_ptr + part * stride_x_part + x_offsets, mask=mask, other=0.0)
        x = x.to(residual_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r_offsets = (rows.to(tl.int64) * stride_r_row)[:, None] + cols[None, :]
        residual = tl.load(residual_ptr + r_offsets, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + r_offsets, x, mask=mask)
    xf = x.to(tl.float32)
    if SUM_SQUARES_ONLY:
        tl.store(out_ptr + rows, tl.sum(xf * xf, 1), mask=row_mask)
        return
    mean_square = tl.math.div_rn(tl.sum(xf * xf, 1), HIDDEN)
    inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_square + eps))  # as torch.rsqrt on CPU
    normed = (xf * inv_rms[:, None]).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    out = (normed * weight[None, :]).to(out_ptr.dtype.element_ty)
    o_offsets = (outer * stride_o_outer + inner * stride_o_inner)[:, None] + cols[None, :]
    tl.store(out_ptr + o_offsets, out, mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[int, int, int]:
    """(inner_rows, outer stride, inner stride) of a 2-D or 3-D tensor's rows."""
    if t.dim() == 2:
        return 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[1], t.stride(0), t.stride(1)
    raise ValueError(f"expected a 2-D or 3-D tensor, got shape {tuple(t.shape)}")


def _launch(x, residual, weight, out, eps, pdl, sum_squares_only=False, num_parts=0):
    """``num_parts`` > 0: ``x`` is ``[P, T, H]`` float32 partial sums of one ``[T, H]`` input."""
    hidden = x.shape[-1]
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the normalised dim must be contiguous")
    part_stride = 0
    if num_parts:
        part_stride = x.stride(0)
        x = x[0]
    num_rows = x.numel() // hidden
    if num_rows == 0:
        return
    inner_rows, sx_outer, sx_inner = _row_layout(x)
    _, so_outer, so_inner = _row_layout(x if sum_squares_only else out)
    block_h = triton.next_power_of_2(hidden)
    rows = max(1, _ELEMENTS_PER_PROGRAM // block_h)
    launch(
        _rms_norm_kernel,
        (triton.cdiv(num_rows, rows),),
        x,
        residual if residual is not None else x,
        weight,
        out,
        num_rows,
        inner_rows,
        sx_outer,
        sx_inner,
        part_stride,
        residual.stride(0) if residual is not None else 0,
        so_outer,
        so_inner,
        eps,
        HIDDEN=hidden,
        BLOCK_H=block_h,
        ROWS=rows,
        HAS_RESIDUAL=residual is not None,
        SUM_SQUARES_ONLY=sum_squares_only,
        NUM_PARTS=num_parts,
        PDL=pdl,
        num_warps=8 if block_h >= 4096 else 4,
        launch_pdl=pdl,
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (``[T, H]``, or ``[T, heads, D]`` for q/k norm, any
    strides with a contiguous last dim); returns ``out`` (allocated like ``x`` if None).
    ``pdl``: launch with programmatic dependent launch (`ember.kernels.pdl`)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, out, eps, pdl)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False
) -> None:
    """In place on ``[T, H]`` tensors: ``residual += x`` then ``x = rmsnorm(residual) * weight``."""
    if x.dim() != 2 or residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError("x and residual must be [T, H] with a contiguous last dim")
    _launch(x, residual, weight, x, eps, pdl)


def add_parts_rms_norm(
    residual: torch.Tensor,
    parts: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """``residual += sum(parts)`` in place (the float32 sum rounded to ``residual``'s dtype
    first, then the add rounded, as `fused_add_rms_norm` adds a product), and returns
    ``rmsnorm(residual) * weight`` in ``out`` (``[T, H]`` like ``residual``; new if None).
    ``parts``: ``[P, T, H]`` float32, each ``[T, H]`` slice contiguous in its last dim."""
    if parts.dim() != 3 or parts.dtype != torch.float32 or parts.shape[1:] != residual.shape:
        raise ValueError(
            f"parts must be float32 [P, T, H] over residual's [T, H] = {tuple(residual.shape)}, "
            f"got {parts.dtype} {tuple(parts.shape)}"
        )
    if residual.dim() != 2 or residual.stride(-1) != 1 or parts.stride(1) != parts.shape[2]:
        raise ValueError("residual and each part must be [T, H] with contiguous rows")
    if out is None:
        out = torch.empty_like(residual)
    _launch(parts, residual, weight, out, eps, pdl, num_parts=parts.shape[0])
    return out


def add_and_sum_squares(
    residual: torch.Tensor, x: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """``residual += x`` in place (rounded to the dtype, as the fused norm adds) on ``[T, H]``
    tensors, and each row's sum of squares after it: float32 ``[T, 1]``, the partial sums of a
    deferred RMSNorm (`ember.layers.row_norm.RowNorm`). ``x`` None: the sums of ``residual``
    alone."""
    if residual.dim() != 2 or residual.stride(-1) != 1:
        raise ValueError("residual must be [T, H] with a contiguous last dim")
    if x is not None and (x.shape != residual.shape or x.stride(-1) != 1):
        raise ValueError("x must be shaped like residual, with a contiguous last dim")
    sums = torch.empty(residual.shape[0], 1, dtype=torch.float32, device=residual.device)
    if x is None:
        _launch(residual, None, residual, sums, 0.0, pdl, sum_squares_only=True)
    else:
        _launch(x, residual, residual, sums, 0.0, pdl, sum_squares_only=True)
    return sums
