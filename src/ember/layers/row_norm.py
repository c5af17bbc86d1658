"""A deferred RMSNorm: each row's 1/rms of the residual stream, still as partial sums of squares.

With the decoder's RMSNorm weights folded into the projections they feed (``W diag(g)``, at
load), a projection can read the residual stream itself and the row's ``1/rms`` can be applied by
whichever kernel reads the product next (attention to its q/k/v, SiLU-and-mul to gate and up):
no norm kernel runs. The kernel that added to the stream leaves the sums of squares of its
columns of each row (``parts [T, P]``, one column per program); the reader adds the P numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowNorm:
    """RMSNorm statistics of a ``[T, hidden_size]`` tensor's rows: ``parts`` is float32
    ``[T, P]`` (contiguous), the row's sum of squares split over P columns."""

    parts: torch.Tensor
    hidden_size: int
    eps: float

    def __post_init__(self) -> None:
        if self.parts.dim() != 2 or self.parts.dtype != torch.float32:
            raise ValueError(
                f"parts must be float32 [T, P], got {self.parts.dtype} {tuple(self.parts.shape)}"
            )
        if not self.parts.is_contiguous():
            raise ValueError("parts must be contiguous")

    def inv_rms(self) -> torch.Tensor:
        """float32 ``[T]``: ``1 / sqrt(mean square + eps)`` of each row."""
        mean_square = self.parts.sum(-1) / self.hidden_size
        return 1.0 / torch.sqrt(mean_square + self.eps)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[T, ...]``) scaled by its row's ``1/rms`` in fp32, rounded to its dtype, as a
        projection of the normalised row would come out of its GEMM."""
        scale = self.inv_rms().view(-1, *([1] * (x.dim() - 1)))
        return (x.float() * scale).to(x.dtype)
