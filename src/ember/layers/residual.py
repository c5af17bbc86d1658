"""The decoder's residual stream between sub-blocks, in one of two forms.

Plain: ``hidden`` rows plus ``pending``, the last sub-block's output not added yet (the next
fused add + RMSNorm kernel adds it): ``[T, H]``, or ``[P, T, H]`` float32 split-K partial sums
(`Ops.linear_parts`) that the add + norm sums first. Deferred norm (`ember.layers.row_norm`):
every output is added and ``row_norm`` holds the new rows' RMSNorm statistics; the norms'
weights were folded into the projections they feed at load, so a projection reads ``hidden``
itself and the kernel after it applies ``1/rms``. At decode sizes the skinny GEMM's epilogue
does the add and the statistics: the step runs no norm kernel inside the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.layers.ops import Ops
from ember.layers.row_norm import RowNorm
from ember.parallel.group import ParallelGroup


@dataclass(frozen=True)
class ResidualStream:
    hidden: torch.Tensor
    eps: float
    pending: torch.Tensor | None = None
    row_norm: RowNorm | None = None


def start_stream(ops: Ops, hidden: torch.Tensor, eps: float, deferred: bool) -> ResidualStream:
    """The stream at the embeddings; ``deferred``: in the deferred-norm form."""
    if not deferred:
        return ResidualStream(hidden, eps)
    return ResidualStream(
        hidden, eps, row_norm=_row_norm(ops.add_and_sum_squares(hidden), hidden, eps)
    )


def sub_block_input(
    ops: Ops, stream: ResidualStream, norm_weight: torch.Tensor
) -> tuple[torch.Tensor, RowNorm | None, ResidualStream]:
    """What a pre-norm sub-block's first projection reads: ``(x, row_norm, stream)``. Plain:
    ``x`` is the normalised stream (anything pending added first), ``row_norm`` None. Deferred:
    ``x`` is the stream itself and ``row_norm`` its statistics, for the projection's reader."""
    if stream.row_norm is not None:
        return stream.hidden, stream.row_norm, stream
    if stream.pending is None:
        return ops.rms_norm(stream.hidden, norm_weight, stream.eps), None, stream
    normed = _add_pending_and_norm(ops, stream, norm_weight)
    return normed, None, ResidualStream(stream.hidden, stream.eps)


def add_sub_block_output(
    ops: Ops,
    stream: ResidualStream,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    parallel: ParallelGroup | None = None,
) -> ResidualStream:
    """A sub-block's exit, ``stream + x @ weight.T (+ bias)``: added now with its statistics
    (deferred), or left pending for the next fused add + norm kernel (plain). A bias (gpt-oss's
    o_proj) is added to the product before it joins the stream, as transformers adds it.
    Over several ranks (``parallel``), ``x`` and ``weight`` are this rank's columns of a
    row-parallel projection: the product is summed over the ranks (one all-reduce) before it
    joins the stream the same way, and the bias added once, after the sum."""
    if parallel is not None and parallel.size > 1:
        out = parallel.all_reduce(ops.linear(x, weight))
        if bias is not None:
            out += bias
        return add_sub_block_result(ops, stream, out)
    if bias is not None:
        return add_sub_block_result(ops, stream, ops.linear(x, weight, bias))
    if stream.row_norm is not None:
        parts = ops.linear_add(x, weight, stream.hidden)
        return ResidualStream(
            stream.hidden, stream.eps, row_norm=_row_norm(parts, stream.hidden, stream.eps)
        )
    product = ops.linear_parts or ops.linear
    return ResidualStream(stream.hidden, stream.eps, pending=product(x, weight))


def add_sub_block_result(ops: Ops, stream: ResidualStream, out: torch.Tensor) -> ResidualStream:
    """A sub-block's exit whose output ``out`` [T, H] is already computed (a mixture of experts'
    weighted sum has no last projection to fuse the add into): added now with its statistics
    (deferred), or left pending for the next fused add + norm kernel (plain)."""
    if stream.row_norm is not None:
        parts = ops.add_and_sum_squares(stream.hidden, out)
        return ResidualStream(
            stream.hidden, stream.eps, row_norm=_row_norm(parts, stream.hidden, stream.eps)
        )
    return ResidualStream(stream.hidden, stream.eps, pending=out)


def final_norm(ops: Ops, stream: ResidualStream, norm_weight: torch.Tensor) -> torch.Tensor:
    """The final RMSNorm of the stream (its weight is never folded: the output projection may be
    tied to the embeddings)."""
    if stream.pending is None:
        return ops.rms_norm(stream.hidden, norm_weight, stream.eps)
    return _add_pending_and_norm(ops, stream, norm_weight)


def _add_pending_and_norm(ops: Ops, stream: ResidualStream, norm_weight: torch.Tensor):
    """``hidden += pending`` and the RMSNorm of it (in ``pending``'s place when it is [T, H])."""
    pending = stream.pending
    if pending.dim() == 3:
        return ops.add_parts_rms_norm(stream.hidden, pending, norm_weight, stream.eps)
    ops.fused_add_rms_norm(pending, stream.hidden, norm_weight, stream.eps)
    return pending


def _row_norm(parts: torch.Tensor, hidden: torch.Tensor, eps: float) -> RowNorm:
    return RowNorm(parts, hidden.shape[-1], eps)
