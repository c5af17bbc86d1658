"""The compute primitives a model calls, as one swappable object per model instance.

`reference_ops()` is plain PyTorch (CPU, and the correctness oracle on a GPU);
`triton_ops()` is the Triton fast path. Both take and return the same tensors, so the model code
is written once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

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
    # (q, k, v, ctx, cos_sin_cache, k_cache, v_cache, scale, out) -> out: rope_and_cache_write
    # then paged_attention over the step's ForwardContext, as one op so a backend may fuse them.
    rope_and_attention: Callable[..., torch.Tensor]
    sample: Callable[..., torch.Tensor]
    # float32 [B, V] -> int64 [B]: the first maximum of each row (all-greedy batches).
    greedy_argmax: Callable[[torch.Tensor], torch.Tensor]
    # Whether a forward pass can be captured in a CUDA graph: the reference ops pick rows with
    # boolean masks and read lengths back to the host, which capture forbids.
    capturable: bool
    # Whether the kernels launch with programmatic dependent launch (ember.kernels.pdl).
    programmatic_launch: bool = False
    # Decode-sized steps (`fuses_norm_linear(rows, dtype, device)`) run the residual stream
    # through the skinny GEMMs: `fused_linear_add` (`skinny_gemm_add`'s contract) adds a
    # projection into the stream, `fused_norm_linear` (`skinny_norm_gemm`'s) normalises it into
    # the next one, with the norms' weights folded into the projections at load. None: always
    # the separate kernels.
    fused_linear_add: Callable[..., torch.Tensor] | None = None
    fused_norm_linear: Callable[..., torch.Tensor] | None = None
    fuses_norm_linear: Callable[[int, torch.dtype, torch.device], bool] | None = None

    def folds_norm_weights(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a model on these ops multiplies each decoder RMSNorm's weight into the
        projection after it at load (the fused kernels expect it; the separate ones then
        normalise with a weight of ones)."""
        return self.fuses_norm_linear is not None and self.fuses_norm_linear(1, dtype, device)

    def _fuses(self, stream: ResidualStream, weight: torch.Tensor) -> bool:
        rows = stream.hidden.shape[0]
        return (
            stream.pending is None
            and self.fuses_norm_linear is not None
            and self.fuses_norm_linear(rows, weight.dtype, stream.hidden.device)
        )

    def norm_linear(
        self,
        stream: ResidualStream,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        gated: bool = False,
    ) -> tuple[torch.Tensor, ResidualStream]:
        """A pre-norm sub-block's entry: ``linear(rms_norm(h), weight, bias)`` of the stream's
        rows ``h`` (``silu_and_mul`` of it with ``gated``), and the stream with nothing
        pending."""
        if self._fuses(stream, weight):
            out = self.fused_norm_linear(stream.hidden, weight, eps, bias, gated=gated,
                                         sum_sq_parts=stream.sum_sq_parts)  # fmt: skip
            return out, stream
        hidden, pending = stream.hidden, stream.pending
        if pending is None:
            normed = self.rms_norm(hidden, norm_weight, eps)
        else:
            self.fused_add_rms_norm(pending, hidden, norm_weight, eps)
            normed = pending
        out = self.linear(normed, weight, bias)
        return (self.silu_and_mul(out) if gated else out), ResidualStream(hidden)

    def linear_add(
        self, x: torch.Tensor, weight: torch.Tensor, stream: ResidualStream
    ) -> ResidualStream:
        """A sub-block's exit: the stream plus ``x @ weight.T``, added in the GEMM's epilogue at
        decode sizes and left pending for the next norm kernel otherwise."""
        if self._fuses(stream, weight):
            parts = self.fused_linear_add(x, weight, stream.hidden)
            return ResidualStream(stream.hidden, sum_sq_parts=parts)
        return ResidualStream(stream.hidden, pending=self.linear(x, weight))

    def final_norm(
        self, stream: ResidualStream, norm_weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``rms_norm`` of the stream's rows, anything pending added first."""
        if stream.pending is None:
            return self.rms_norm(stream.hidden, norm_weight, eps)
        self.fused_add_rms_norm(stream.pending, stream.hidden, norm_weight, eps)
        return stream.pending


@dataclass(frozen=True)
class ResidualStream:
    """A decoder's residual stream between sub-blocks: ``hidden`` rows, plus the last
    sub-block's output when it is not added yet (``pending``; the separate kernels add it in the
    next norm), or the partial sums of squares of ``hidden``'s rows from the GEMM that added it
    (``sum_sq_parts``; the fused kernels)."""

    hidden: torch.Tensor
    pending: torch.Tensor | None = None
    sum_sq_parts: torch.Tensor | None = None


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
        rope_and_attention=ref.rope_and_attention_reference,
        sample=ref.sample_reference,
        greedy_argmax=partial(torch.argmax, dim=-1),
        capturable=False,
    )


def triton_ops(
    programmatic_launch: bool = False,
    decode_rope_in_attention: bool = True,
    fused_norm_linear: bool = True,
) -> Ops:
    """The Triton kernels; ``programmatic_launch`` launches the ones of a forward pass with PDL
    (Hopper and later; the sampler's kernels run after host-visible torch ops and keep plain
    launches); ``decode_rope_in_attention`` lets decode steps rotate and write the cache inside
    the attention kernel; ``fused_norm_linear`` lets decode-sized steps fold each RMSNorm (and
    the SiLU gate) into the projection after it."""
    from ember import kernels
    from ember.kernels.linear import use_fused_norm_gemm
    from ember.kernels.skinny_gemm import skinny_gemm_add, skinny_norm_gemm

    def chained(op):
        return partial(op, pdl=True) if programmatic_launch else op

    rope_and_attention = kernels.rope_and_attention
    if not decode_rope_in_attention:
        rope_and_attention = partial(rope_and_attention, fuse_decode=False)

    return Ops(
        name="triton",
        linear=chained(kernels.linear),
        rms_norm=chained(kernels.rms_norm),
        fused_add_rms_norm=chained(kernels.fused_add_rms_norm),
        silu_and_mul=chained(kernels.silu_and_mul),
        rope_and_cache_write=chained(kernels.rope_and_cache_write),
        paged_attention=chained(kernels.paged_attention),
        rope_and_attention=chained(rope_and_attention),
        sample=kernels.sample,
        greedy_argmax=kernels.greedy_argmax,
        capturable=True,
        programmatic_launch=programmatic_launch,
        fused_linear_add=chained(skinny_gemm_add) if fused_norm_linear else None,
        fused_norm_linear=chained(skinny_norm_gemm) if fused_norm_linear else None,
        fuses_norm_linear=use_fused_norm_gemm if fused_norm_linear else None,
    )


def select_ops(
    device: torch.device,
    backend: str = "auto",
    programmatic_launch: bool = False,
    decode_rope_in_attention: bool = True,
    fused_norm_linear: bool = True,
) -> Ops:
    """Triton on CUDA unless asked otherwise; the reference everywhere else.

    ``programmatic_launch`` where the GPU does not support it is an error.
    """
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return reference_ops()
    if backend not in ("auto", "triton"):
        raise ValueError(f"unknown attention backend {backend!r}; choose auto, triton or reference")
    from ember.kernels.pdl import supports_programmatic_launch

    if programmatic_launch and not supports_programmatic_launch(device):
        raise ValueError("programmatic dependent launch needs a CUDA GPU of compute capability 9+")
    return triton_ops(programmatic_launch, decode_rope_in_attention, fused_norm_linear)
