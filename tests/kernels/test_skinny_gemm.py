"""Skinny (decode) GEMM: kernel vs a float64 matmul, plain, with bias, and with SiLU-and-mul fused."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.skinny_gemm import MAX_M, skinny_gemm
from ember.layers.reference_ops import silu_and_mul_reference


def _expected(x, weight, bias, gated):
    x_in = silu_and_mul_reference(x) if gated else x
    out = x_in.double() @ weight.double().t()
    if bias is not None:
        out += bias.double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "use_bias", "gated"),
    [
        (1, 96, 512, False, False),  # K a multiple of BLOCK_K, N a multiple of BLOCK_N
        (3, 100, 300, True, False),  # partial last column tile, K not a multiple of BLOCK_K
        (16, 40, 256, False, True),  # gated: x is [M, 2K]
        (33, 70, 200, True, True),  # BLOCK_M 64, every edge partial
    ],
)
def test_kernel_matches_matmul(gen, device, dtype, m, n, k, use_bias, gated):
    width = 2 * k if gated else k
    buffer = torch.randn(m, width + 8, generator=gen).to(dtype)
    x = buffer[:, :width]  # strided rows, as a fused projection's slice is
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if use_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    skinny_gemm(
        x.to(device), weight.to(device), None if bias is None else bias.to(device),
        gated=gated, out=out,
    )  # fmt: skip
    expected = _expected(x, weight, bias, gated)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)
    else:  # one bf16 rounding of an fp32 sum
        torch.testing.assert_close(out.cpu().double(), expected, atol=2e-2, rtol=1e-2)


def test_rejects_bad_shapes(device):
    w = torch.zeros(8, 32, device=device)
    with pytest.raises(ValueError, match="at most"):
        skinny_gemm(torch.zeros(MAX_M + 1, 32, device=device), w)
    with pytest.raises(ValueError, match="gate"):
        skinny_gemm(torch.zeros(2, 32, device=device), w, gated=True)


def test_empty_batch(device):
    out = skinny_gemm(torch.zeros(0, 32, device=device), torch.zeros(8, 32, device=device))
    assert out.shape == (0, 8)
