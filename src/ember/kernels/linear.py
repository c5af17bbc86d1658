"""A linear layer's product, routed to cuBLAS or to a Triton GEMM by shape.

On an H200 (8B shapes, bf16, batch 1-64) cuBLAS runs the layers whose output is no wider than
their input (attention output, MLP down) as split-K plus a reduce kernel. The skinny kernel
needs no reduce: in the engine's decode step at batch 64 (`ember bench profile`) o + down + the
vocabulary projection took 1,723 us per step against cuBLAS's 1,805 (reduces included); at batch
1 the kernel time is the same (1,689 vs 1,675 us) with 64 fewer launches per step. On q/k/v and
gate/up the two tied in `ember bench tune`, so gate/up stays on cuBLAS; q/k/v (K < N < 4 K) at
batch 1 beat cuBLAS by 1 us when timed in sequence and took 77 us off the step (4.346 against
4.422 and 4.425 ms in one call), and at batch 4-16 21-34 us (in-call A/B of 2026-12-01, second
session; bench/results/README.md), so it takes the skinny kernel up to 16 rows. Under programmatic
dependent launch (`ember.kernels.pdl`) every decode-sized product takes the skinny kernel: a
cuBLAS kernel in the chain neither starts early nor lets the next kernel start early.

`linear_add` is a sub-block's exit into the residual stream under a deferred RMSNorm
(`ember.layers.row_norm`): where the skinny kernel takes the product, its epilogue adds it to the
stream and sums the squares (no launch of its own); elsewhere cuBLAS and `add_and_sum_squares`.
`gate_up_silu` is the gated MLP's gate/up product and SiLU-and-mul, in one launch where a
fused kernel measured faster: the skinny one (`skinny_gemm_silu`) up to 64 rows (under PDL it
took 27-58 us off the step at batch 1-8), the stream-K kernel's one-wave form at 65-128 rows
(`ember.kernels.stream_k_gemm`; -31 to -238 us a step at batch 80-128 on the H200). Past 128
rows, and for every other product past 64, cuBLAS measured faster than either Triton GEMM.

`linear_parts` is a sub-block's exit in the plain residual form (past the skinny GEMM's rows):
where cuBLAS would run the product as split-K plus a reduce kernel (output no wider than the
input), one batched cuBLAS GEMM leaves the K slices' float32 partial sums and the next
add + RMSNorm kernel (`add_parts_rms_norm`) sums them, so the reduce and its launch go.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.kernels.activation import silu_and_mul
from ember.kernels.rmsnorm import add_and_sum_squares
from ember.kernels.skinny_gemm import MAX_M, skinny_gemm, skinny_gemm_add, skinny_gemm_silu
from ember.kernels.stream_k_gemm import stream_k_gemm, use_stream_k_gemm
from ember.layers.row_norm import RowNorm

_HALF_DTYPES = (torch.bfloat16, torch.float16)

# `linear_parts`' split-K: the rows it serves, the most K slices and the fewest K columns a slice
# keeps; 1 part turns it off. On the H200 (8B shapes, `ember bench tune --split-k`) two parts beat
# cuBLAS's own split-K and reduce on down at 96-256 rows (-3 to -7 us a layer) and on o at 96-192
# (-1 to -4; a tie at 256); four lost to two on both. In the step: -0.10 / -0.21 / -0.09 ms at
# batch 128 / 192 / 256 (bench/results/README.md, "Split-K partial sums reduced in the norm").
SPLIT_K_ROWS = (MAX_M + 1, 256)
SPLIT_K_MAX_PARTS = 2
SPLIT_K_MIN_PART_K = 2048


def use_skinny_gemm(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, pdl: bool = False
) -> bool:
    """Whether ``[m, k] x [n, k]^T`` goes to the skinny kernel (measured wins only)."""
    if device.type != "cuda" or dtype not in _HALF_DTYPES or not 0 < m <= MAX_M:
        return False
    return pdl or n <= k or n >= 16 * k or (m <= 16 and n < 4 * k)


def use_gated_skinny_gemm(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, pdl: bool = False
) -> bool:
    """Whether `gate_up_silu` takes the fused kernel: where the product would take the skinny
    kernel anyway (under PDL), and with plain launches past 16 rows, where the fused kernel beat
    cuBLAS and the SiLU kernel (in-call A/B of 2026-12-01, third session: -40 us per step at
    batch 32, +22 us at batch 16; bench/results/README.md)."""
    return use_skinny_gemm(m, n, k, dtype, device, pdl=pdl or m > 16)


def split_k_parts(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> int:
    """K slices `linear_parts` cuts ``[m, k] x [n, k]^T`` into; 1: no split. Only products no
    wider than their input (those cuBLAS splits itself) at the rows of SPLIT_K_ROWS; each slice
    a multiple of 8 columns (16-byte rows for cuBLAS) and at least SPLIT_K_MIN_PART_K."""
    low, high = SPLIT_K_ROWS
    if device.type != "cuda" or dtype not in _HALF_DTYPES or not low <= m <= high or n > k:
        return 1
    parts = SPLIT_K_MAX_PARTS
    while parts > 1 and (k % (8 * parts) or k // parts < SPLIT_K_MIN_PART_K):
        parts //= 2
    return parts


def linear_parts(
    x: torch.Tensor, weight: torch.Tensor, *, parts: int | None = None, pdl: bool = False
) -> torch.Tensor:
    """``x @ weight.T`` for an add + RMSNorm to take: ``[T, N]`` in ``x``'s dtype (`linear`),
    or, where `split_k_parts` splits it (``parts``, if given, instead), ``[P, T, N]`` float32
    partial sums over P equal slices of K from one batched cuBLAS GEMM (`add_parts_rms_norm`
    sums them)."""
    m, k = x.shape
    n = weight.shape[0]
    if parts is None:
        parts = split_k_parts(m, n, k, weight.dtype, x.device)
    elif k % parts:
        raise ValueError(f"K={k} does not split into {parts} equal parts")
    if parts == 1 or not (x.is_contiguous() and weight.is_contiguous()):
        return linear(x, weight, pdl=pdl)
    # Slice p of K is x[:, p*s:(p+1)*s] @ weight[:, p*s:(p+1)*s].T: strided views, no copies.
    x_slices = x.view(m, parts, k // parts).transpose(0, 1)
    w_slices = weight.view(n, parts, k // parts).permute(1, 2, 0)
    return torch.bmm(x_slices, w_slices, out_dtype=torch.float32)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """``F.linear`` semantics for 2-D ``x``; ``pdl``: the step's kernels use programmatic
    dependent launch."""
    m, k = x.shape
    if x.stride(1) == 1 and use_skinny_gemm(m, weight.shape[0], k, weight.dtype, x.device, pdl):
        return skinny_gemm(x, weight, bias, pdl=pdl)
    return F.linear(x, weight, bias)


def linear_add(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *, pdl: bool = False
) -> torch.Tensor:
    """``residual += x @ weight.T`` in place (the product rounded to the dtype first), returning
    the new rows' partial sums of squares, float32 ``[T, P]`` (`RowNorm`'s ``parts``)."""
    m, k = x.shape
    if x.stride(1) == 1 and use_skinny_gemm(m, weight.shape[0], k, weight.dtype, x.device, pdl):
        return skinny_gemm_add(x, weight, residual, pdl=pdl)
    return add_and_sum_squares(residual, F.linear(x, weight), pdl=pdl)


def gate_up_silu(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    *,
    row_norm: RowNorm | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``silu_and_mul(x @ gate_up_weight.T, row_norm=row_norm)``: ``[T, I]`` from the fused
    ``[2I, K]`` gate/up weight (gate rows first). Past the skinny GEMM's rows, up to 128, the
    product and SiLU-and-mul run as one kernel of whole tensor-core tiles (`ember.kernels.
    stream_k_gemm`): against cuBLAS and the SiLU kernel, -4 to -6 us a layer at 128 rows on the
    H200 (`ember bench tune --stream-k`)."""
    m, k = x.shape
    n = gate_up_weight.shape[0]
    if x.stride(1) == 1 and use_gated_skinny_gemm(m, n, k, gate_up_weight.dtype, x.device, pdl):
        return skinny_gemm_silu(x, gate_up_weight, row_norm=row_norm, pdl=pdl)
    if row_norm is None and use_stream_k_gemm(x, gate_up_weight):
        return stream_k_gemm(x, gate_up_weight, gated=True, pdl=pdl)
    return silu_and_mul(F.linear(x, gate_up_weight), row_norm=row_norm, pdl=pdl)
