"""Skinny (decode) GEMM: kernel vs a float64 matmul; its routing and tile sizes."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.skinny_gemm import MAX_M, skinny_gemm, skinny_gemm_silu
from ember.layers.reference_ops import gate_up_silu_reference


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "inter", "k"),
    [
        (1, 128, 512),  # K a multiple of BLOCK_K, I a multiple of BLOCK_N
        (7, 100, 300),  # partial last column tile, K not a multiple of BLOCK_K
        (40, 70, 200),  # BLOCK_M 64, every edge partial
    ],
)
def test_gated_kernel_matches_gemm_then_silu_and_mul(gen, device, dtype, m, inter, k):
    """`skinny_gemm_silu` (gate/up product and SiLU-and-mul in one kernel) against the two ops
    it stands for, in float64; also with the default tiles (two weight tiles per stage)."""
    buffer = torch.randn(m, k + 8, generator=gen).to(dtype)
    x = buffer[:, :k]  # strided rows
    weight = (torch.randn(2 * inter, k, generator=gen) * 2 / k**0.5).to(dtype)
    expected = gate_up_silu_reference(x.double(), weight.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the two products each rounded
    for config in (
        None,
        {
            "BLOCK_M": 64 if m > 16 else 16,
            "BLOCK_N": 32,
            "BLOCK_K": 64,
            "STAGES": 2,
            "num_warps": 4,
        },
    ):
        out = torch.full((m, inter), float("nan"), dtype=dtype, device=device)
        skinny_gemm_silu(x.to(device), weight.to(device), out=out, config=config)
        torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


def test_gated_kernel_rejects_an_odd_weight(device):
    with pytest.raises(ValueError, match="odd number of rows"):
        skinny_gemm_silu(torch.zeros(2, 32, device=device), torch.zeros(7, 32, device=device))


def test_rejects_bad_shapes(device):
    w = torch.zeros(8, 32, device=device)
    with pytest.raises(ValueError, match="at most"):
        skinny_gemm(torch.zeros(MAX_M + 1, 32, device=device), w)
    with pytest.raises(ValueError, match="columns"):
        skinny_gemm(torch.zeros(2, 16, device=device), w)


def test_empty_batch(device):
    out = skinny_gemm(torch.zeros(0, 32, device=device), torch.zeros(8, 32, device=device))
    assert out.shape == (0, 8)


def test_routing_follows_the_routes():
    """Which products the skinny kernel takes is the routes' (one GPU's table): those no wider
    than their input or far wider (the vocabulary), q/k/v-like ones up to their row limit, none
    past the kernel's rows or in fp32 or off CUDA; another table routes otherwise."""
    from ember.kernels.linear import LinearRouter
    from ember.kernels.tuning import LinearRoutes

    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    routes = LinearRoutes()
    takes = LinearRouter(routes).takes_skinny
    qkv_rows = routes.skinny_qkv_max_rows
    assert takes(1, 4096, 4096, bf16, cuda)  # attention output
    assert takes(routes.skinny_max_rows, 4096, 14336, bf16, cuda)  # MLP down
    assert takes(8, 128256, 4096, bf16, cuda)  # vocabulary projection
    assert takes(1, 6144, 4096, bf16, cuda) and takes(qkv_rows, 6144, 4096, bf16, cuda)
    assert not takes(qkv_rows + 1, 6144, 4096, bf16, cuda)  # q/k/v above: cuBLAS
    assert not takes(1, 28672, 4096, bf16, cuda)  # gate/up: 7x wider
    assert not takes(routes.skinny_max_rows + 1, 4096, 4096, bf16, cuda)
    assert not takes(0, 4096, 4096, bf16, cuda)
    assert not takes(1, 4096, 4096, torch.float32, cuda)  # fp32 stays exact on cuBLAS
    assert not takes(1, 4096, 4096, bf16, cpu)
    other = LinearRouter(LinearRoutes(skinny_qkv_max_rows=4))
    assert not other.takes_skinny(8, 6144, 4096, bf16, cuda) and takes(8, 6144, 4096, bf16, cuda)


def test_gated_routing_follows_the_routes():
    from ember.kernels.linear import LinearRouter
    from ember.kernels.tuning import LinearRoutes

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    routes = LinearRoutes()
    takes = LinearRouter(routes).takes_gated_skinny
    plain_max = routes.gated_plain_max_rows
    assert takes(1, 28672, 4096, bf16, cuda, pdl=True)  # under PDL: every size
    assert takes(plain_max, 28672, 4096, bf16, cuda, pdl=True)
    assert not takes(plain_max, 28672, 4096, bf16, cuda)  # plain: cuBLAS + SiLU
    assert takes(plain_max + 1, 28672, 4096, bf16, cuda)  # plain past them: fused
    assert takes(routes.skinny_max_rows, 28672, 4096, bf16, cuda)
    assert not takes(routes.skinny_max_rows + 1, 28672, 4096, bf16, cuda, pdl=True)
    assert not takes(32, 28672, 4096, torch.float32, cuda)
    assert not takes(32, 28672, 4096, bf16, torch.device("cpu"))


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("m", [1, 16, 32, 33, 64])
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
    gated = default_config(m, 28672, 4096, elem_bytes, gated=True)
    assert shared_memory_estimate(gated, elem_bytes, gated=True) <= SHARED_MEMORY_BUDGET
    # Two half-width weight tiles: a stage moves the ungated tile's bytes.
    assert shared_memory_estimate(gated, elem_bytes, gated=True) == shared_memory_estimate(
        default_config(m, 28672, 4096, elem_bytes), elem_bytes
    )


@pytest.mark.parametrize("m", [1, 16, 33, 64])
def test_fp8_weights_take_twice_the_k_where_the_tiles_still_fit(m):
    """An FP8 weight's tiles move as many weight bytes a stage as a bf16 weight's."""
    from ember.kernels.skinny_gemm import default_config, shared_memory_estimate
    from ember.kernels.tiles import SHARED_MEMORY_BUDGET

    for n, k in [(4096, 4096), (4096, 14336), (128256, 4096), (6144, 4096), (28672, 4096)]:
        for gated in (False, True) if n == 28672 else (False,):
            half = default_config(m, n, k, 2, gated)
            fp8 = default_config(m, n, k, 2, gated, weight_bytes=1)
            assert shared_memory_estimate(fp8, 2, gated, 1) <= SHARED_MEMORY_BUDGET
            fits = shared_memory_estimate({**half, "BLOCK_K": 2 * half["BLOCK_K"]}, 2, gated, 1)
            if fits <= SHARED_MEMORY_BUDGET:
                assert fp8 == {**half, "BLOCK_K": 2 * half["BLOCK_K"]}
