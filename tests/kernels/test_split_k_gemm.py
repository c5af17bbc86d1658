"""Split-K GEMM for mid-sized batches: kernel vs a float64 matmul; its counters, splits and
routing."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.split_k_gemm import (
    COUNTER_CAPACITY,
    SplitKWorkspace,
    choose_split_k,
    default_config,
    split_k_gemm,
)

# Small tiles keep the interpreter quick; SPLIT_K 3 leaves the last slice shorter than the rest.
_SMALL = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "STAGES": 2, "num_warps": 4}


def _expected(x, weight, bias):
    out = x.double() @ weight.double().t()
    if bias is not None:
        out += bias.double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "split", "use_bias"),
    [
        (70, 96, 256, 1, False),  # one slice: the tile is stored straight away
        (70, 100, 256, 2, True),  # partial last row and column tiles
        (65, 64, 320, 3, False),  # 10 K steps in slices of 4, 4, 2
        (130, 40, 512, 4, True),  # five row tiles, one partial column tile
    ],
)
def test_kernel_matches_matmul(gen, device, dtype, m, n, k, split, use_bias):
    buffer = torch.randn(m, k + 16, generator=gen).to(dtype)
    x = buffer[:, :k]  # strided rows, as a slice of a fused projection is
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if use_bias else None
    workspace = SplitKWorkspace(device, num_sms=8)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    split_k_gemm(x.to(device), weight.to(device), None if bias is None else bias.to(device),
                 workspace=workspace, out=out, config={**_SMALL, "SPLIT_K": split})  # fmt: skip
    expected = _expected(x, weight, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)
    else:  # one bf16 rounding of an fp32 sum
        torch.testing.assert_close(out.cpu().double(), expected, atol=2e-2, rtol=1e-2)
    # The summing programs zeroed their counters again: the next launch (or a graph's replay)
    # counts from zero.
    assert not workspace.counters.any()


def test_a_second_launch_on_the_same_workspace_gives_the_same_bits(gen, device):
    x = torch.randn(96, 256, generator=gen).to(torch.bfloat16).to(device)
    weight = (torch.randn(64, 256, generator=gen) / 16).to(torch.bfloat16).to(device)
    workspace = SplitKWorkspace(device, num_sms=8)
    config = {**_SMALL, "SPLIT_K": 4}
    first = split_k_gemm(x, weight, workspace=workspace, config=config)
    second = split_k_gemm(x, weight, workspace=workspace, config=config)
    assert torch.equal(first, second)


def test_default_config_runs(gen, device):
    """The default tiles (128 x 128, the splits `choose_split_k` gives 8 SMs) on a shape with
    a partial row tile."""
    x = torch.randn(100, 1024, generator=gen).to(device)
    weight = (torch.randn(256, 1024, generator=gen) / 32).to(device)
    workspace = SplitKWorkspace(device, num_sms=8)
    assert default_config(100, 256, 1024, 8, elem_bytes=4)["SPLIT_K"] == 2  # 2 x 2 tiles
    out = split_k_gemm(x, weight, workspace=workspace)
    torch.testing.assert_close(out.cpu().double(), _expected(x.cpu(), weight.cpu(), None),
                               atol=1e-4, rtol=1e-4)  # fmt: skip


def test_rejects_bad_input(device):
    workspace = SplitKWorkspace(device, num_sms=8)
    w = torch.zeros(8, 64, device=device)
    with pytest.raises(ValueError, match="columns"):
        split_k_gemm(torch.zeros(70, 32, device=device), w, workspace=workspace)
    with pytest.raises(ValueError, match="multiple of BLOCK_K"):
        split_k_gemm(torch.zeros(70, 48, device=device), torch.zeros(8, 48, device=device),
                     workspace=workspace, config={**_SMALL, "SPLIT_K": 1})  # fmt: skip
    with pytest.raises(ValueError, match="contiguous"):
        split_k_gemm(torch.zeros(64, 70, device=device).t(), w, workspace=workspace)
    many_tiles = {**_SMALL, "BLOCK_N": 16, "SPLIT_K": 2}
    wide = torch.zeros(16 * (COUNTER_CAPACITY + 1), 64, device=device)
    with pytest.raises(ValueError, match="exceed the workspace"):
        split_k_gemm(torch.zeros(8, 64, device=device), wide, workspace=workspace,
                     config=many_tiles)  # fmt: skip
    with pytest.raises(ValueError, match="num_sms"):
        SplitKWorkspace(torch.device("cpu"))


def test_empty_batch(device):
    workspace = SplitKWorkspace(device, num_sms=8)
    out = split_k_gemm(torch.zeros(0, 64, device=device), torch.zeros(8, 64, device=device),
                       workspace=workspace)  # fmt: skip
    assert out.shape == (0, 8)


def test_splits_fill_whole_waves():
    # The 8B model's narrow projections at 256 rows on 132 SMs, in 128 x 128 tiles.
    assert choose_split_k(64, 64, 132) == 2  # o: 128 programs, one wave
    assert choose_split_k(64, 224, 132) == 2  # down (K = 14,336)
    assert choose_split_k(96, 64, 132) == 4  # q/k/v: 384 of 396 slots in three waves
    assert choose_split_k(32, 64, 132) == 4  # o at 128 rows
    assert choose_split_k(132, 64, 132) == 1  # already one full wave
    assert choose_split_k(64, 8, 132) == 1  # K too short to cut


@pytest.mark.parametrize("m", [65, 128, 200, 256])
def test_default_configs_fit_in_shared_memory(m):
    from ember.kernels.tiles import SHARED_MEMORY_BUDGET

    for n, k in [(4096, 4096), (4096, 14336), (6144, 4096)]:
        config = default_config(m, n, k, 132)
        smem = (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * 2 * config["STAGES"]
        assert smem <= SHARED_MEMORY_BUDGET
        assert k % config["BLOCK_K"] == 0


def test_routing_takes_mid_batch_narrow_projections():
    from ember.kernels.linear import use_split_k_gemm

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert use_split_k_gemm(65, 6144, 4096, bf16, cuda)  # q/k/v
    assert use_split_k_gemm(256, 4096, 4096, bf16, cuda)  # o
    assert use_split_k_gemm(200, 4096, 14336, bf16, cuda)  # down
    assert not use_split_k_gemm(64, 4096, 4096, bf16, cuda)  # the skinny kernel's rows
    assert not use_split_k_gemm(257, 4096, 4096, bf16, cuda)  # enough row tiles for cuBLAS
    assert not use_split_k_gemm(256, 28672, 4096, bf16, cuda)  # gate/up: 224+ tiles already
    assert not use_split_k_gemm(256, 128256, 4096, bf16, cuda)  # vocabulary projection
    assert not use_split_k_gemm(256, 4096, 4100, bf16, cuda)  # K not in whole steps
    assert not use_split_k_gemm(256, 4096, 4096, torch.float32, cuda)
    assert not use_split_k_gemm(256, 4096, 4096, bf16, torch.device("cpu"))


def test_ops_take_the_workspace_on_cuda_only():
    from ember.layers.ops import select_ops, triton_ops

    assert not hasattr(select_ops(torch.device("cpu"), "triton", split_k_gemm=True).linear,
                       "keywords")  # fmt: skip
    workspace = SplitKWorkspace(torch.device("cpu"), num_sms=8)
    assert triton_ops(split_k=workspace).linear.keywords == {"split_k": workspace}
