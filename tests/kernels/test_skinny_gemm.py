"""Skinny (decode) GEMM: kernel vs a float64 matmul; its routing and tile sizes."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.skinny_gemm import MAX_M, skinny_gemm


def _expected(x, weight, bias):
    out = x.double() @ weight.double().t()
    if bias is not None:
        out += bias.double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "use_bias"),
    [
        (1, 96, 512, False),  # K a multiple of BLOCK_K, N a multiple of BLOCK_N
        (3, 100, 300, True),  # partial last column tile, K not a multiple of BLOCK_K
        (16, 40, 256, False),
        (33, 70, 200, True),  # BLOCK_M 64, every edge partial
        (64, 2000, 100, False),  # N >= 16 K: the output-projection tiles
        (5, 600, 128, False),  # N >= 4 K: the gate/up tiles
        (2, 200, 48, True),  # K shorter than one tile
    ],
)
def test_kernel_matches_matmul(gen, device, dtype, m, n, k, use_bias):
    buffer = torch.randn(m, k + 8, generator=gen).to(dtype)
    x = buffer[:, :k]  # strided rows, as a slice of a fused projection is
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if use_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    skinny_gemm(x.to(device), weight.to(device), None if bias is None else bias.to(device), out=out)
    expected = _expected(x, weight, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)
    else:  # one bf16 rounding of an fp32 sum
        torch.testing.assert_close(out.cpu().double(), expected, atol=2e-2, rtol=1e-2)


def test_rejects_bad_shapes(device):
    w = torch.zeros(8, 32, device=device)
    with pytest.raises(ValueError, match="at most"):
        skinny_gemm(torch.zeros(MAX_M + 1, 32, device=device), w)
    with pytest.raises(ValueError, match="columns"):
        skinny_gemm(torch.zeros(2, 16, device=device), w)


def test_empty_batch(device):
    out = skinny_gemm(torch.zeros(0, 32, device=device), torch.zeros(8, 32, device=device))
    assert out.shape == (0, 8)


def test_routing_follows_the_measured_wins():
    from ember.kernels.linear import use_skinny_gemm

    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    assert use_skinny_gemm(1, 4096, 4096, bf16, cuda)  # attention output
    assert use_skinny_gemm(64, 4096, 14336, bf16, cuda)  # MLP down
    assert use_skinny_gemm(8, 128256, 4096, bf16, cuda)  # vocabulary projection
    assert not use_skinny_gemm(1, 6144, 4096, bf16, cuda)  # q/k/v: a tie, cuBLAS kept
    assert not use_skinny_gemm(1, 28672, 4096, bf16, cuda)  # gate/up: a tie
    assert not use_skinny_gemm(MAX_M + 1, 4096, 4096, bf16, cuda)
    assert not use_skinny_gemm(0, 4096, 4096, bf16, cuda)
    assert not use_skinny_gemm(1, 4096, 4096, torch.float32, cuda)  # fp32 stays exact on cuBLAS
    assert not use_skinny_gemm(1, 4096, 4096, bf16, cpu)


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("m", [1, 16, 33, 64])
def test_default_configs_fit_in_shared_memory(m, elem_bytes):
    from ember.kernels.skinny_gemm import (
        default_config,
        shared_memory_estimate,
    )
    from ember.kernels.tiles import SHARED_MEMORY_BUDGET

    for n, k in [(4096, 4096), (4096, 14336), (128256, 4096), (6144, 4096), (28672, 4096)]:
        config = default_config(m, n, k, elem_bytes)
        assert config["BLOCK_M"] >= m
        assert shared_memory_estimate(config, elem_bytes) <= SHARED_MEMORY_BUDGET


def _rms_normed_linear(hidden, norm_weight, weight, bias, gated):
    """The reference: HF's RMSNorm, then the projection (and SiLU gate)."""
    from ember.layers.reference_ops import rms_norm_reference, silu_and_mul_reference

    out = torch.nn.functional.linear(rms_norm_reference(hidden, norm_weight, 1e-5), weight, bias)
    return silu_and_mul_reference(out) if gated else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 96, 512), (3, 100, 300), (33, 70, 200), (64, 40, 256), (2, 24, 48)],
)
def test_gemm_add_updates_the_residual_and_sums_its_squares(gen, device, dtype, m, n, k):
    from ember.kernels.skinny_gemm import skinny_gemm_add

    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    residual = (4 * torch.randn(m, n, generator=gen)).to(dtype)
    hidden = residual.clone().to(device)  # (.to on the same device would alias)
    parts = skinny_gemm_add(x.to(device), weight.to(device), hidden)
    # HF adds the projection rounded to the dtype: bf16(residual + bf16(x @ W.T)).
    product = (x.double() @ weight.double().t()).to(dtype)
    expected = (residual.float() + product.float()).to(dtype)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 8e-2, "rtol": 2e-2}
    torch.testing.assert_close(hidden.cpu(), expected, **tol)
    assert parts.dtype == torch.float32 and parts.shape[1] == m and parts.shape[0] >= 1
    squares = hidden.cpu().double().pow(2).sum(1)
    torch.testing.assert_close(parts.cpu().double().sum(0), squares, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("from_parts", [False, True])
@pytest.mark.parametrize(
    ("m", "n", "k", "gated", "use_bias"),
    [
        (1, 96, 512, False, False),  # decode of one sequence, K a multiple of BLOCK_K
        (3, 100, 300, True, False),  # gated, partial column tile, ragged K
        (33, 70, 200, False, True),  # q/k/v bias
        (64, 40, 256, True, False),  # the largest batch the kernel takes
        (2, 24, 48, True, False),  # K shorter than one tile
    ],
)
def test_norm_gemm_matches_norm_then_linear(
    gen, device, dtype, from_parts, m, n, k, gated, use_bias
):
    from ember.kernels.skinny_gemm import fold_norm_weight, skinny_norm_gemm

    hidden = (4 * torch.randn(m, k, generator=gen)).to(dtype)
    norm_weight = (1 + 0.5 * torch.randn(k, generator=gen)).to(dtype)
    weight = (torch.randn(2 * n if gated else n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if use_bias else None
    expected = _rms_normed_linear(hidden, norm_weight, weight, bias, gated)

    folded = weight.clone()
    fold_norm_weight(folded, norm_weight)
    parts = None
    if from_parts:  # three programs' worth of partial sums, as skinny_gemm_add leaves them
        squares = hidden.float().pow(2)
        parts = torch.stack([c.sum(1) for c in squares.tensor_split(3, dim=1)]).to(device)
    on = (lambda t: None if t is None else t.to(device))  # fmt: skip
    out = skinny_norm_gemm(on(hidden), on(folded), 1e-5, on(bias), sum_sq_parts=parts, gated=gated)
    assert out.shape == (m, n)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)
    else:  # the norm is applied after the dot, the weight before it: a few roundings apart
        torch.testing.assert_close(out.cpu().float(), expected.float(), atol=4e-2, rtol=3e-2)


def test_fused_gemms_reject_bad_input(device):
    from ember.kernels.skinny_gemm import skinny_gemm_add, skinny_norm_gemm

    x, w = torch.zeros(2, 32, device=device), torch.zeros(8, 32, device=device)
    with pytest.raises(ValueError, match="residual"):
        skinny_gemm_add(x, w, torch.zeros(2, 9, device=device))
    with pytest.raises(ValueError, match="no bias"):
        skinny_norm_gemm(x, w, 1e-5, torch.zeros(4, device=device), gated=True)
    with pytest.raises(ValueError, match="rows"):
        skinny_norm_gemm(x, torch.zeros(7, 32, device=device), 1e-5, gated=True)
    with pytest.raises(ValueError, match="sum_sq_parts"):
        skinny_norm_gemm(x, w, 1e-5, sum_sq_parts=torch.zeros(3, 5, device=device))
    with pytest.raises(ValueError, match="at most"):
        skinny_norm_gemm(torch.zeros(MAX_M + 1, 32, device=device), w, 1e-5)


def test_fold_norm_weight_scales_the_input_columns():
    from ember.kernels.skinny_gemm import fold_norm_weight

    weight = torch.arange(6, dtype=torch.float32).view(2, 3)
    fold_norm_weight(weight, torch.tensor([1.0, 2.0, 0.5]))
    assert weight.tolist() == [[0.0, 2.0, 1.0], [3.0, 8.0, 2.5]]


def test_fused_norm_routing():
    from ember.kernels.linear import use_fused_norm_gemm
    from ember.layers.ops import reference_ops, triton_ops

    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    assert use_fused_norm_gemm(1, bf16, cuda) and use_fused_norm_gemm(MAX_M, bf16, cuda)
    assert not use_fused_norm_gemm(MAX_M + 1, bf16, cuda)  # prefill chunks: norm + cuBLAS
    assert not use_fused_norm_gemm(0, bf16, cuda)
    assert not use_fused_norm_gemm(1, torch.float32, cuda)  # fp32 stays exact on cuBLAS
    assert not use_fused_norm_gemm(1, bf16, cpu)
    assert triton_ops().folds_norm_weights(bf16, cuda)
    assert not triton_ops().folds_norm_weights(torch.float32, cuda)
    assert not triton_ops(fused_norm_linear=False).folds_norm_weights(bf16, cuda)
    assert not reference_ops().folds_norm_weights(bf16, cuda)
