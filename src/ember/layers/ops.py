"""The compute primitives a model calls, as one swappable object per model instance.

`reference_ops()` is plain PyTorch (CPU, and the correctness oracle on a GPU);
`triton_ops()` is the Triton fast path, routed by the device's `KernelTuning`. Both take and
return the same tensors, so the model code is written once. Attention has its own per-instance
object (`ember.layers.attention`), since what it needs depends on the model's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial

import torch

from ember.config import PDL_MODES
from ember.dependencies import require_triton
from ember.kernels.tuning import KernelTuning


@dataclass(frozen=True)
class Ops:
    name: str
    # (x, weight, bias) -> x @ weight.T + bias, as F.linear. Every op that takes a weight takes
    # an `ember.layers.fp8.Fp8Weight` in its place (docs/CONTRACTS.md, "FP8 weights").
    linear: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    # (x, residual, weight, eps) -> None; residual += x, x = rms_norm(residual) in place.
    fused_add_rms_norm: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]
    # (x, gate_up_weight, row_norm=None) -> [T, I]: silu_and_mul(linear(x, gate_up_weight)), as
    # one op so a backend may fuse the activation into the product's epilogue.
    gate_up_silu: Callable[..., torch.Tensor]
    # (x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights float32 [T, k], topk_ids int32
    # [T, k], activation="silu", b13=None, b2=None) -> [T, H] in x's dtype: each token's routed
    # experts, weighted and summed (docs/CONTRACTS.md, "Mixture of experts"; the Triton ops'
    # kernels: "Fused MoE"); w13 and w2 may be `Fp8Weight`s (scales [E, 2I], [E, H]) or packed
    # `ember.layers.mxfp4.Mxfp4Weight`s ("MXFP4 experts").
    moe_experts: Callable[..., torch.Tensor]
    # (routing, logits [T, E], top_k, norm_topk_prob) -> (topk_weights float32 [T, k],
    # topk_ids int32 [T, k]): a MoE router's choice (`ember.layers.moe_routing`).
    moe_route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    sample: Callable[..., torch.Tensor]
    # [B, V] float32, bfloat16 or float16 -> int64 [B]: the first maximum of each row
    # (all-greedy batches).
    greedy_argmax: Callable[[torch.Tensor], torch.Tensor]
    # Whether a forward pass can be captured in a CUDA graph: the reference ops pick rows with
    # boolean masks and read lengths back to the host, which capture forbids.
    capturable: bool
    # When the kernels launch with programmatic dependent launch: "auto", "on" or "off"
    # (PDL_MODES); under "auto", the step sizes (rows) that do.
    programmatic_launch: str = "off"
    pdl_rows: frozenset[int] = field(default_factory=frozenset)
    # Deferred RMSNorm (ember.layers.row_norm): whether a model on these ops folds its decoder
    # norms' weights into the projections they feed, where its architecture allows.
    defer_norms: bool = False
    # The most rows (tokens) of a forward pass that runs the deferred form; larger ones run the
    # plain form (norm kernels, with the folded norms' weights of ones). None: no limit.
    defer_norms_max_rows: int | None = None
    # (x, weight, residual) -> float32 [T, P]: residual += x @ weight.T, and the new rows'
    # partial sums of squares (RowNorm.parts).
    linear_add: Callable[..., torch.Tensor] | None = None
    # (residual, x=None) -> float32 [T, 1]: residual += x, and each row's sum of squares.
    add_and_sum_squares: Callable[..., torch.Tensor] | None = None
    # (x, weight) -> a plain-form sub-block's output, x @ weight.T: [T, N] in x's dtype, or
    # [P, T, N] float32 split-K partial sums for add_parts_rms_norm. None: `linear`.
    linear_parts: Callable[..., torch.Tensor] | None = None
    # (residual, parts [P, T, H] float32, weight, eps) -> [T, H]: residual += the parts' sum
    # (rounded to its dtype), then its RMSNorm, as fused_add_rms_norm does for a [T, H] input.
    add_parts_rms_norm: Callable[..., torch.Tensor] | None = None
    # (workers, counts) -> a context manager inside which launches only queue their kernels'
    # compiles on that many threads, counting compiles and cache hits into ``counts``
    # (`ember.kernels.compile_ahead`); None: nothing to compile (the reference ops, or Triton's
    # CPU interpreter).
    compile_ahead: Callable[..., AbstractContextManager] | None = None

    def launches_with_pdl(self, rows: int) -> bool:
        """Whether a step of ``rows`` tokens launches its kernels with PDL."""
        mode = self.programmatic_launch
        return mode == "on" or (mode == "auto" and rows in self.pdl_rows)


def reference_ops(defer_norms: bool = False, split_k_parts: int = 1) -> Ops:
    """Plain PyTorch; ``defer_norms`` runs the deferred-norm form too and ``split_k_parts`` > 1
    leaves every plain-form sub-block output as that many partial sums (both for their tests)."""
    from ember.layers import reference_ops as ref
    from ember.layers.moe_routing import route_reference

    linear_parts = None
    if split_k_parts > 1:
        linear_parts = partial(ref.linear_parts_reference, parts=split_k_parts)
    return Ops(
        name="reference",
        linear=ref.linear_reference,
        rms_norm=ref.rms_norm_reference,
        fused_add_rms_norm=ref.fused_add_rms_norm_reference,
        silu_and_mul=ref.silu_and_mul_reference,
        gate_up_silu=ref.gate_up_silu_reference,
        moe_experts=ref.moe_experts_reference,
        moe_route=route_reference,
        sample=ref.sample_reference,
        greedy_argmax=partial(torch.argmax, dim=-1),
        capturable=False,
        defer_norms=defer_norms,
        linear_add=ref.linear_add_reference,
        add_and_sum_squares=ref.add_and_sum_squares_reference,
        linear_parts=linear_parts,
        add_parts_rms_norm=ref.add_parts_rms_norm_reference,
    )


def _launch_by_rows(op, pdl_rows: frozenset[int], x: torch.Tensor, *args, **kwargs):
    """``op`` with PDL where ``pdl_rows`` has the step's rows (``x``'s first dim: every step
    kernel's first operand has one row per token, or per sample for the logits)."""
    return op(x, *args, pdl=x.shape[0] in pdl_rows, **kwargs)


def triton_ops(
    programmatic_launch: str = "off",
    defer_norms: bool = True,
    tuning: KernelTuning | None = None,
) -> Ops:
    """The Triton kernels, routed by ``tuning`` (the device's; None: the defaults).
    ``programmatic_launch`` ("auto", "on", "off") launches the ones of a forward pass with PDL:
    "auto" at the tuning's step sizes (Hopper and later; the sampler's kernels run after
    host-visible torch ops and keep plain launches). A step may mix PDL and plain launches: a
    kernel launched with PDL waits for the one before either way. ``defer_norms``: models fold
    their decoder norms into the projections (`ember.layers.row_norm`)."""
    require_triton()
    from ember.kernels import activation, argmax, rmsnorm, sampling
    from ember.kernels.compile_ahead import compile_ahead, kernels_interpreted
    from ember.kernels.fused_moe import fused_moe
    from ember.kernels.linear import LinearRouter
    from ember.kernels.moe_route import moe_route

    if programmatic_launch not in PDL_MODES:
        raise ValueError(
            f"programmatic_launch must be one of {PDL_MODES}, not {programmatic_launch!r}"
        )
    tuning = tuning or KernelTuning()
    router = LinearRouter(tuning.linear)

    def chained(op):
        if programmatic_launch == "on":
            return partial(op, pdl=True)
        if programmatic_launch == "auto":
            return partial(_launch_by_rows, op, tuning.pdl_rows)
        return op

    return Ops(
        name="triton",
        linear=chained(router.linear),
        rms_norm=chained(rmsnorm.rms_norm),
        fused_add_rms_norm=chained(rmsnorm.fused_add_rms_norm),
        silu_and_mul=chained(activation.silu_and_mul),
        gate_up_silu=chained(router.gate_up_silu),
        sample=sampling.sample,
        greedy_argmax=argmax.greedy_argmax,
        capturable=True,
        programmatic_launch=programmatic_launch,
        pdl_rows=tuning.pdl_rows,
        defer_norms=defer_norms,
        # Deferring pays where the skinny GEMM's epilogues take the norms' work (no kernel of
        # their own); past it, cuBLAS runs either form with as many kernels.
        defer_norms_max_rows=tuning.defer_norms_max_rows,
        linear_add=chained(router.linear_add),
        add_and_sum_squares=chained(rmsnorm.add_and_sum_squares),
        linear_parts=chained(router.linear_parts),
        add_parts_rms_norm=chained(rmsnorm.add_parts_rms_norm),
        compile_ahead=None if kernels_interpreted() else compile_ahead,
        # The fused MoE kernels, their paths and tiles from the device's table; plain launches
        # (no PDL in them yet: a step's chain waits at them as at a cuBLAS kernel).
        moe_experts=partial(fused_moe, tuning=tuning.moe),
        moe_route=moe_route,
    )


def select_ops(
    device: torch.device,
    backend: str = "auto",
    programmatic_launch: str = "off",
    defer_norms: bool = True,
    tuning: KernelTuning | None = None,
) -> Ops:
    """Triton on CUDA unless asked otherwise; the reference everywhere else (its norms never
    deferred: it is the oracle the fast path is checked against).

    ``programmatic_launch`` "on" where the GPU does not support it is an error; "auto" there
    launches plainly.
    """
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return reference_ops()
    if backend not in ("auto", "triton"):
        raise ValueError(f"unknown backend {backend!r}; choose auto, triton or reference")
    require_triton()
    from ember.kernels.pdl import supports_programmatic_launch

    if programmatic_launch != "off" and not supports_programmatic_launch(device):
        if programmatic_launch == "on":
            raise ValueError(
                "programmatic dependent launch needs a CUDA GPU of compute capability 9+"
            )
        programmatic_launch = "off"
    return triton_ops(programmatic_launch, defer_norms, tuning)
