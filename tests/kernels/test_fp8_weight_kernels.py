"""FP8 weights in the Triton kernels (interpreted on a CPU) against the reference: the skinny
GEMM with every epilogue (bias, residual add with its sums of squares, SiLU-and-mul with a
deferred norm's 1/rms), the per-token activation quantization, and how the router sends FP8
products. The ``torch._scaled_mm`` path runs here where torch has the op on the CPU (its
routing asks for a GPU); tests/gpu/test_gpu_fp8_weights.py runs it on cuBLASLt."""

from __future__ import annotations

import pytest
import torch
from helpers.scaled_mm import cpu_has_scaled_mm

from ember.kernels import fp8_gemm
from ember.kernels.fp8_gemm import fp8_linear, quantize_rows_fp8, takes_scaled_mm
from ember.kernels.linear import LinearRouter
from ember.kernels.skinny_gemm import skinny_gemm, skinny_gemm_add, skinny_gemm_silu
from ember.kernels.tuning import LinearRoutes
from ember.layers.fp8 import FP8_DTYPE, Fp8Weight, dense_weight, quantize_rows
from ember.layers.reference_ops import (
    gate_up_silu_reference,
    linear_add_reference,
    linear_reference,
)
from ember.layers.row_norm import RowNorm


def fp8_weight(gen, n: int, k: int, device) -> Fp8Weight:
    """A random weight quantized per row, as a model's FP8 projections hold it."""
    weight, scale = quantize_rows(torch.randn(n, k, generator=gen) * 2 / k**0.5)
    return Fp8Weight(weight.to(device), scale[:, 0].contiguous().to(device))


def on_cpu_in_double(weight: Fp8Weight) -> torch.Tensor:
    return dense_weight(Fp8Weight(weight.weight.cpu(), weight.scale.cpu()), torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "use_bias"),
    [
        (1, 96, 512, False),  # K a multiple of BLOCK_K
        (3, 100, 300, True),  # partial last column tile, K not a multiple of BLOCK_K
        (33, 70, 200, True),  # BLOCK_M 64, every edge partial
    ],
)
def test_skinny_gemm_with_an_fp8_weight_matches_the_dequantized_product(
    gen, device, dtype, m, n, k, use_bias
):
    x = torch.randn(m, k + 8, generator=gen).to(dtype)[:, :k]  # strided rows
    weight = fp8_weight(gen, n, k, device)
    bias = torch.randn(n, generator=gen).to(dtype) if use_bias else None
    out = skinny_gemm(x.to(device), weight, None if bias is None else bias.to(device))
    expected = x.double() @ on_cpu_in_double(weight).t()
    if bias is not None:
        expected += bias.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: one rounding of an fp32 sum
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_row_norm", [False, True])
def test_gated_skinny_gemm_with_an_fp8_weight_scales_gate_and_up_rows_apart(
    gen, device, dtype, with_row_norm
):
    """Gate and up rows carry their own scales (the fused weight's halves, quantized apart):
    the epilogue must scale each product by its own rows' scales before the SiLU."""
    m, inter, k = 5, 80, 256
    x = torch.randn(m, k, generator=gen).to(dtype)
    gate = fp8_weight(gen, inter, k, device)
    up = fp8_weight(gen, inter, k, device)
    up = Fp8Weight(up.weight, up.scale * 7)  # far from gate's scales
    weight = Fp8Weight(torch.cat([gate.weight, up.weight]), torch.cat([gate.scale, up.scale]))
    row_norm = None
    if with_row_norm:
        parts = torch.rand(m, 3, generator=gen) * 300
        row_norm = RowNorm(parts, 256, 1e-5)
    on_device = None if row_norm is None else RowNorm(row_norm.parts.to(device), 256, 1e-5)
    out = skinny_gemm_silu(x.to(device), weight, row_norm=on_device)
    expected = gate_up_silu_reference(x.double(), on_cpu_in_double(weight), row_norm=row_norm)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_gemm_add_with_an_fp8_weight_updates_the_stream(gen, device, dtype):
    m, n, k = 3, 100, 300
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = fp8_weight(gen, n, k, device)
    residual = torch.randn(m, n, generator=gen).to(dtype)
    got = residual.clone().to(device)
    parts = skinny_gemm_add(x.to(device), weight, got)
    expected = residual.clone()
    cpu_weight = Fp8Weight(weight.weight.cpu(), weight.scale.cpu())
    expected_sums = linear_add_reference(x, cpu_weight, expected)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(parts.cpu().sum(-1), expected_sums[:, 0], atol=tol * k, rtol=tol)


@pytest.mark.parametrize("in_registers", [False, True], ids=["converted", "in-registers"])
def test_every_finite_fp8_code_widens_to_its_value(device, in_registers):
    """The 254 finite e4m3 codes as a weight with unit scales, each column read out by a
    one-hot row: the product is the widened code itself, exact in bf16. ``in_registers``: the
    bit form of `ember.kernels.fp8_widen` (compiled only; the interpreter converts)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[codes == 0x7F] = 0  # the two NaN codes
    codes[codes == 0xFF] = 0x80
    weight = codes.view(FP8_DTYPE).reshape(16, 16)  # [N, K]
    scale = torch.ones(16, dtype=torch.float32)
    x = torch.eye(16, dtype=torch.bfloat16)  # row m reads column m of every weight row
    out = skinny_gemm(
        x.to(device),
        Fp8Weight(weight.to(device), scale.to(device)),
        fp8_widen_in_registers=in_registers,
    )
    expected = weight.to(torch.bfloat16).t()
    assert torch.equal(out.cpu(), expected)  # -0 codes sum to +0 with the other rows' zeros


@pytest.mark.parametrize("in_registers", [False, True], ids=["converted", "in-registers"])
def test_the_router_widens_fp8_as_its_routes_say(gen, device, in_registers):
    """`LinearRoutes.fp8_widen_in_registers` reaches the skinny kernels of all three products
    (the same values either way: the widening is exact)."""
    router = LinearRouter(LinearRoutes(fp8_widen_in_registers=in_registers))
    m, n, k = 2, 64, 256
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    weight = fp8_weight(gen, n, k, device)
    gate_up = fp8_weight(gen, 2 * n, k, device)
    residual = torch.zeros(m, n, dtype=torch.bfloat16, device=device)
    if device.type == "cuda":
        got = (router.linear(x, weight), router.gate_up_silu(x, gate_up))
        router.linear_add(x, weight, residual)
        expected = (skinny_gemm(x, weight), skinny_gemm_silu(x, gate_up))
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert torch.equal(residual, expected[0])
    assert router._fp8_widening == {"fp8_widen_in_registers": in_registers}


def test_an_fp8_weight_without_its_scale_is_refused(device):
    weight = torch.zeros(8, 32, dtype=FP8_DTYPE, device=device)
    with pytest.raises(ValueError, match="needs its scale"):
        skinny_gemm(torch.zeros(2, 32, device=device), weight)
    with pytest.raises(ValueError, match="one value per row"):
        bad_scale = torch.ones(4, device=device)
        skinny_gemm(torch.zeros(2, 32, device=device), Fp8Weight(weight, bad_scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [48, 3000])  # one column block; several, the last partial
def test_activation_rows_quantize_as_the_reference_does(gen, device, dtype, k):
    """Bit for bit: the same scales (one per row, a zero row's the smallest) and the same
    float8 values (a correctly rounded division, rounded to nearest even)."""
    x = (torch.randn(6, k + 4, generator=gen) * torch.logspace(-3, 2, 6)[:, None]).to(dtype)
    x[2] = 0  # a padding row
    x = x[:, :k]
    q, scale = quantize_rows_fp8(x.to(device))
    expected_q, expected_scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (6, 1)
    assert torch.equal(scale.cpu(), expected_scale)
    assert torch.equal(q.cpu().view(torch.uint8), expected_q.view(torch.uint8))
    assert not q[2].float().any()


def test_the_router_sends_decode_sized_fp8_products_to_the_skinny_kernel():
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    routes = LinearRoutes()
    router = LinearRouter(routes)
    assert router.takes_fp8_skinny(1, bf16, cuda)
    assert router.takes_fp8_skinny(routes.fp8_skinny_max_rows, torch.float16, cuda)
    assert not router.takes_fp8_skinny(routes.fp8_skinny_max_rows + 1, bf16, cuda)  # _scaled_mm
    assert not router.takes_fp8_skinny(0, bf16, cuda)
    assert not router.takes_fp8_skinny(4, torch.float32, cuda)  # dequantized, exact fp32
    assert not router.takes_fp8_skinny(4, bf16, torch.device("cpu"))


def test_fp8_products_off_the_scaled_mm_path_run_dequantized(gen, device):
    """On a CPU (and for float32 or misaligned products on a GPU) the weight is dequantized:
    the reference's product exactly, through each of the router's ops (the SiLU kernel after
    it rounds as the reference's SiLU, but for its last bits)."""
    x = torch.randn(70, 64, generator=gen).to(device)  # float32: no _scaled_mm on a GPU either
    weight = fp8_weight(gen, 96, 64, device)
    assert not takes_scaled_mm(x, weight)
    router = LinearRouter(LinearRoutes())
    expected = linear_reference(x, weight)
    assert torch.equal(fp8_linear(x, weight), expected)
    assert torch.equal(router.linear(x, weight), expected)
    assert torch.equal(router.linear_parts(x, weight), expected)
    gated = router.gate_up_silu(x, weight)
    torch.testing.assert_close(gated, gate_up_silu_reference(x, weight), atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not cpu_has_scaled_mm(), reason="this torch has no CPU _scaled_mm")
def test_the_scaled_mm_path_multiplies_the_quantized_activations_by_the_fp8_weight(
    gen, monkeypatch
):
    """The operands as ``_scaled_mm`` takes them (the weight column-major, row scales ``[M, 1]``
    and column scales ``[1, N]``), the bias after: the product of the dequantized activations
    and weight, rounded to bf16."""
    monkeypatch.setattr(fp8_gemm, "takes_scaled_mm", lambda x, weight: True)
    x = torch.randn(70, 64 + 16, generator=gen).to(torch.bfloat16)[:, :64]
    weight = fp8_weight(gen, 96, 64, "cpu")
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    out = fp8_linear(x, weight, bias)
    q, row_scale = quantize_rows(x)
    exact = (q.float() * row_scale) @ dense_weight(weight, torch.float32).t() + bias.float()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=1e-2)
