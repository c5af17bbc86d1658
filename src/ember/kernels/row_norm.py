"""Reading a deferred RMSNorm (`ember.layers.row_norm.RowNorm`) inside a kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from ember.layers.row_norm import RowNorm

# Partial sums a reader loads at once (one load, no loop: it sits on the reader's critical path).
# The skinny GEMMs leave hidden size / BLOCK_N of them: 128 for an 8B model.
_MAX_PARTS = 4096


@triton.jit
def load_row_parts(parts_ptr, row, num_parts, BLOCK_P: tl.constexpr):
    """Row ``row``'s (a scalar) ``num_parts <= BLOCK_P`` partial sums of squares (readers issue
    this with their first loads and reduce it after them)."""
    cols = tl.arange(0, BLOCK_P)
    return tl.load(
        parts_ptr + row.to(tl.int64) * num_parts + cols, mask=cols < num_parts, other=0.0
    )


@triton.jit
def inv_rms_of(parts, hidden, eps):
    """``1 / sqrt(mean square + eps)`` from a row's partial sums, with the RMSNorm kernel's
    correctly rounded division and square root."""
    return _inv_rms_of_sum(tl.sum(parts, 0), hidden, eps)


@triton.jit
def _inv_rms_of_sum(sum_of_squares, hidden, eps):
    mean_square = tl.math.div_rn(sum_of_squares, hidden * 1.0)  # div_rn takes fp32 only
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_square + eps))


@triton.jit
def load_inv_rms_rows(parts_ptr, rows, row_valid, num_parts, hidden, eps, BLOCK_P: tl.constexpr):
    """`inv_rms_of` each of a tile's ``rows`` (a vector; ``row_valid`` masks the padding, which
    comes out as ``1/sqrt(eps)``), loaded here: float32 ``[len(rows)]``."""
    cols = tl.arange(0, BLOCK_P)
    offsets = rows[:, None].to(tl.int64) * num_parts + cols[None, :]
    mask = row_valid[:, None] & (cols < num_parts)[None, :]
    return _inv_rms_of_sum(
        tl.sum(tl.load(parts_ptr + offsets, mask=mask, other=0.0), 1), hidden, eps
    )


@triton.jit
def load_inv_rms(parts_ptr, row, num_parts, hidden, eps, BLOCK_P: tl.constexpr):
    """`inv_rms_of` the row's partial sums, loaded here."""
    return inv_rms_of(load_row_parts(parts_ptr, row, num_parts, BLOCK_P), hidden, eps)


@triton.jit
def scale_and_round(x, scale, dtype: tl.constexpr, SCALED: tl.constexpr):
    """fp32 ``x * scale`` rounded to ``dtype`` and back (a deferred RMSNorm's 1/rms applied as
    the GEMM output it stands for would be rounded); ``x`` as fp32 when not ``SCALED``."""
    if SCALED:
        return (x.to(tl.float32) * scale).to(dtype).to(tl.float32)
    return x.to(tl.float32)


def row_norm_args(row_norm: RowNorm | None, like) -> tuple:
    """A kernel's ``(parts_ptr, num_parts, hidden, eps)`` for ``row_norm`` (``like`` stands in
    for the pointer when there is none), and its ``BLOCK_P``."""
    if row_norm is None:
        return (like, 0, 1, 0.0), 16
    num_parts = row_norm.parts.shape[1]
    if num_parts > _MAX_PARTS:
        raise ValueError(f"row_norm has {num_parts} partial sums per row, over {_MAX_PARTS}")
    block_p = max(16, triton.next_power_of_2(num_parts))
    return (row_norm.parts, num_parts, row_norm.hidden_size, row_norm.eps), block_p


def check_row_norm(row_norm: RowNorm | None, num_rows: int) -> None:
    if row_norm is not None and row_norm.parts.shape[0] < num_rows:
        raise ValueError(f"row_norm covers {row_norm.parts.shape[0]} rows, fewer than {num_rows}")
