"""A linear layer's products, routed by shape to cuBLAS or to a Triton GEMM.

`LinearRouter` holds one GPU's `LinearRoutes` (`ember.kernels.tuning`, which names the measurement
behind each route) and runs the products the model's ops ask for:

- `linear`: ``F.linear``; the skinny GEMM where it measured faster than cuBLAS (decode-sized
  products no wider than their input, where cuBLAS runs split-K plus a reduce kernel; the
  vocabulary projection; q/k/v at the smallest batches; and under PDL every decode-sized product,
  since a cuBLAS kernel breaks the launch chain).
- `linear_add`: a sub-block's exit into the residual stream under a deferred RMSNorm
  (`ember.layers.row_norm`): where the skinny GEMM takes the product, its epilogue adds it to
  the stream and sums the squares; elsewhere cuBLAS and `add_and_sum_squares`.
- `gate_up_silu`: the gated MLP's gate/up product and SiLU-and-mul, in one kernel where a fused
  one measured faster (the skinny GEMM's epilogue; the stream-K kernel's one-wave form).
- `linear_parts`: a sub-block's exit in the plain residual form past the skinny GEMM's rows:
  where cuBLAS would run split-K plus a reduce, one batched cuBLAS GEMM leaves the K slices'
  float32 partial sums for the next add + RMSNorm kernel (`add_parts_rms_norm`) to sum.

Each takes an FP8 weight (`ember.layers.fp8.Fp8Weight`): up to the skinny GEMM's rows it reads
the FP8 tiles itself (half the bytes of a bf16 weight, with every epilogue above); past them
the activations are quantized per token and cuBLASLt multiplies in FP8
(`ember.kernels.fp8_gemm`); the stream-K and split-K forms are bf16 only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.kernels.activation import silu_and_mul
from ember.kernels.fp8_gemm import fp8_linear
from ember.kernels.rmsnorm import add_and_sum_squares
from ember.kernels.skinny_gemm import skinny_gemm, skinny_gemm_add, skinny_gemm_silu
from ember.kernels.stream_k_gemm import fits_one_wave, stream_k_gemm
from ember.kernels.tuning import LinearRoutes
from ember.layers.fp8 import Fp8Weight
from ember.layers.row_norm import RowNorm

_HALF_DTYPES = (torch.bfloat16, torch.float16)


class LinearRouter:
    """Runs linear products on the kernel `LinearRoutes` chooses for their shape."""

    def __init__(self, routes: LinearRoutes) -> None:
        self.routes = routes
        # How the skinny kernel widens FP8 weights (`LinearRoutes.fp8_widen_in_registers`).
        self._fp8_widening = {"fp8_widen_in_registers": routes.fp8_widen_in_registers}

    # -- routing ---------------------------------------------------------------------------------

    def takes_skinny(
        self, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, pdl: bool = False
    ) -> bool:
        """Whether ``[m, k] x [n, k]^T`` goes to the skinny kernel."""
        routes = self.routes
        if (
            device.type != "cuda"
            or dtype not in _HALF_DTYPES
            or not 0 < m <= routes.skinny_max_rows
        ):
            return False
        return pdl or n <= k or n >= 16 * k or (m <= routes.skinny_qkv_max_rows and n < 4 * k)

    def takes_fp8_skinny(self, m: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a product of ``m`` rows of ``dtype`` by an FP8 weight goes to the skinny
        kernel (up to `LinearRoutes.fp8_skinny_max_rows`), which reads the weight's bytes once
        as cuBLASLt's FP8 GEMM does and needs no kernel to quantize its activations."""
        return (
            device.type == "cuda"
            and dtype in _HALF_DTYPES
            and 0 < m <= self.routes.fp8_skinny_max_rows
        )

    def takes_gated_skinny(
        self, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, pdl: bool = False
    ) -> bool:
        """Whether `gate_up_silu` takes the fused skinny kernel: where the product would take the
        skinny kernel anyway (under PDL), and with plain launches past `gated_plain_max_rows`."""
        plain_fused = m > self.routes.gated_plain_max_rows
        return self.takes_skinny(m, n, k, dtype, device, pdl=pdl or plain_fused)

    def takes_stream_k(self, x: torch.Tensor, gate_up_weight: torch.Tensor) -> bool:
        low, high = self.routes.stream_k_rows
        return low <= x.shape[0] <= high and fits_one_wave(x, gate_up_weight)

    def split_k_parts(
        self, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device
    ) -> int:
        """K slices `linear_parts` cuts ``[m, k] x [n, k]^T`` into; 1: no split. Only products no
        wider than their input (those cuBLAS splits itself) at `split_k_rows`; each slice a
        multiple of 8 columns (16-byte rows for cuBLAS) and at least `split_k_min_part_k`."""
        routes = self.routes
        low, high = routes.split_k_rows
        if device.type != "cuda" or dtype not in _HALF_DTYPES or not low <= m <= high or n > k:
            return 1
        parts = routes.split_k_max_parts
        while parts > 1 and (k % (8 * parts) or k // parts < routes.split_k_min_part_k):
            parts //= 2
        return parts

    # -- products --------------------------------------------------------------------------------

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | Fp8Weight,
        bias: torch.Tensor | None = None,
        *,
        pdl: bool = False,
    ) -> torch.Tensor:
        """``F.linear`` semantics for 2-D ``x``; ``pdl``: the step's kernels use programmatic
        dependent launch."""
        m, k = x.shape
        if isinstance(weight, Fp8Weight):
            if x.stride(1) == 1 and self.takes_fp8_skinny(m, x.dtype, x.device):
                return skinny_gemm(x, weight, bias, pdl=pdl, **self._fp8_widening)
            return fp8_linear(x, weight, bias, pdl=pdl)
        if x.stride(1) == 1 and self.takes_skinny(
            m, weight.shape[0], k, weight.dtype, x.device, pdl
        ):
            return skinny_gemm(x, weight, bias, pdl=pdl)
        return F.linear(x, weight, bias)

    def linear_add(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | Fp8Weight,
        residual: torch.Tensor,
        *,
        pdl: bool = False,
    ) -> torch.Tensor:
        """``residual += x @ weight.T`` in place (the product rounded to the dtype first),
        returning the new rows' partial sums of squares, float32 ``[T, P]`` (`RowNorm.parts`)."""
        m, k = x.shape
        if isinstance(weight, Fp8Weight):
            if x.stride(1) == 1 and self.takes_fp8_skinny(m, x.dtype, x.device):
                return skinny_gemm_add(x, weight, residual, pdl=pdl, **self._fp8_widening)
            return add_and_sum_squares(residual, fp8_linear(x, weight, pdl=pdl), pdl=pdl)
        if x.stride(1) == 1 and self.takes_skinny(
            m, weight.shape[0], k, weight.dtype, x.device, pdl
        ):
            return skinny_gemm_add(x, weight, residual, pdl=pdl)
        return add_and_sum_squares(residual, F.linear(x, weight), pdl=pdl)

    def gate_up_silu(
        self,
        x: torch.Tensor,
        gate_up_weight: torch.Tensor | Fp8Weight,
        *,
        row_norm: RowNorm | None = None,
        pdl: bool = False,
    ) -> torch.Tensor:
        """``silu_and_mul(x @ gate_up_weight.T, row_norm=row_norm)``: ``[T, I]`` from the fused
        ``[2I, K]`` gate/up weight (gate rows first)."""
        m, k = x.shape
        if isinstance(gate_up_weight, Fp8Weight):
            if x.stride(1) == 1 and self.takes_fp8_skinny(m, x.dtype, x.device):
                return skinny_gemm_silu(
                    x, gate_up_weight, row_norm=row_norm, pdl=pdl, **self._fp8_widening
                )
            product = fp8_linear(x, gate_up_weight, pdl=pdl)
            return silu_and_mul(product, row_norm=row_norm, pdl=pdl)
        n = gate_up_weight.shape[0]
        if x.stride(1) == 1 and self.takes_gated_skinny(
            m, n, k, gate_up_weight.dtype, x.device, pdl
        ):
            return skinny_gemm_silu(x, gate_up_weight, row_norm=row_norm, pdl=pdl)
        if row_norm is None and self.takes_stream_k(x, gate_up_weight):
            return stream_k_gemm(x, gate_up_weight, gated=True, pdl=pdl)
        return silu_and_mul(F.linear(x, gate_up_weight), row_norm=row_norm, pdl=pdl)

    def linear_parts(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | Fp8Weight,
        *,
        parts: int | None = None,
        pdl: bool = False,
    ) -> torch.Tensor:
        """``x @ weight.T`` for an add + RMSNorm to take: ``[T, N]`` in ``x``'s dtype (`linear`),
        or, where `split_k_parts` splits it (``parts``, if given, instead), ``[P, T, N]``
        float32 partial sums over P equal slices of K from one batched cuBLAS GEMM. An FP8
        weight's product is never split."""
        if isinstance(weight, Fp8Weight):
            return self.linear(x, weight, pdl=pdl)
        m, k = x.shape
        n = weight.shape[0]
        if parts is None:
            parts = self.split_k_parts(m, n, k, weight.dtype, x.device)
        elif k % parts:
            raise ValueError(f"K={k} does not split into {parts} equal parts")
        if parts == 1 or not (x.is_contiguous() and weight.is_contiguous()):
            return self.linear(x, weight, pdl=pdl)
        # Slice p of K is x[:, p*s:(p+1)*s] @ weight[:, p*s:(p+1)*s].T: strided views, no copies.
        x_slices = x.view(m, parts, k // parts).transpose(0, 1)
        w_slices = weight.view(n, parts, k // parts).permute(1, 2, 0)
        return torch.bmm(x_slices, w_slices, out_dtype=torch.float32)
