"""Stream-K GEMM: kernel vs a float64 matmul over program counts that split tiles every way."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from ember.kernels.stream_k_gemm import StreamKWorkspace, default_config, stream_k_gemm
from ember.layers.reference_ops import gate_up_silu_reference

_SMALL = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "STAGES": 2, "num_warps": 4}


def _inputs(gen, device, m, n, k):
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen) * 2 / k**0.5).to(torch.bfloat16)
    return x.to(device), weight.to(device)


@pytest.mark.parametrize(
    ("m", "n", "k", "programs"),
    [
        (70, 96, 64, 8),  # three row tiles (the last partial) in 2 groups that split tiles
        (20, 160, 80, 3),  # K not a multiple of BLOCK_K (TMA fills the rest with zeros)
        (33, 128, 48, 6),  # 3 groups of 2: whole tiles and partial ones
        (40, 64, 64, 50),  # more groups than column tiles: tiles split across groups
        (40, 64, 64, 4),  # a group per column tile: a whole tile each, no partial sums
        (64, 96, 160, 1),  # fewer programs than row tiles: one group does everything
    ],
)
def test_kernel_matches_matmul(gen, device, m, n, k, programs):
    x, weight = _inputs(gen, device, m, n, k)
    workspace = StreamKWorkspace()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
    stream_k_gemm(x, weight, workspace, out=out, config=_SMALL, num_programs=programs)
    expected = x.cpu().double() @ weight.cpu().double().t()
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-2, rtol=1e-2)
    assert workspace.counters is None or not workspace.counters.any(), "tickets left at zero"
    # The partial tiles are added in program order: the same launch gives the same bits.
    again = stream_k_gemm(x, weight, workspace, config=_SMALL, num_programs=programs)
    assert torch.equal(again, out)


@pytest.mark.parametrize(
    ("m", "inter", "k", "programs"),
    [(70, 48, 64, 6), (24, 64, 96, 3), (40, 40, 64, 3)],  # the last: a partial column tile
)
def test_gated_kernel_matches_gemm_then_silu_and_mul(gen, device, m, inter, k, programs):
    x, weight = _inputs(gen, device, m, 2 * inter, k)
    config = dict(_SMALL, BLOCK_N=32)  # 16 gate and 16 up columns a tile
    out = stream_k_gemm(
        x, weight, StreamKWorkspace(), gated=True, config=config, num_programs=programs
    )
    expected = gate_up_silu_reference(x.cpu().double(), weight.cpu().double())
    torch.testing.assert_close(out.cpu().double(), expected, atol=3e-2, rtol=3e-2)


def test_default_tiles_and_programs(gen, device):
    """The tiles and programs the engine launches: tiles that fit in one wave take a program
    each and need no workspace (a small K: the CPU interpreter runs them too)."""
    m, n, k = 100, 512, 64
    x, weight = _inputs(gen, device, m, n, k)
    assert default_config(m, n, k)["BLOCK_M"] == 128
    out = stream_k_gemm(x, weight)
    expected = x.cpu().double() @ weight.cpu().double().t()
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-2, rtol=1e-2)


def test_rejects_bad_operands(device):
    workspace = StreamKWorkspace()
    w = torch.zeros(64, 32, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="columns"):
        stream_k_gemm(torch.zeros(2, 16, dtype=torch.bfloat16, device=device), w, workspace)
    with pytest.raises(ValueError, match="even number"):
        stream_k_gemm(
            torch.zeros(2, 32, dtype=torch.bfloat16, device=device), w[:63], workspace, gated=True
        )


def test_workspace_is_never_regrown(gen, device):
    """A launch that needs more partial sums than the workspace holds raises instead of moving
    the buffers a captured graph may still point at."""
    x, weight = _inputs(gen, device, 64, 128, 64)
    workspace = StreamKWorkspace(partial_elems=2 * 3 * 32 * 32)  # 3 programs' two slots
    launch = partial(stream_k_gemm, x, weight, workspace, config=_SMALL)
    launch(num_programs=3)
    counters = workspace.counters
    with pytest.raises(ValueError, match="partial sums"):
        launch(num_programs=6)
    assert workspace.counters is counters
    with pytest.raises(ValueError, match="need a workspace"):
        stream_k_gemm(x, weight, config=_SMALL, num_programs=6)


def test_gate_up_silu_takes_it_past_the_skinny_kernel(gen, device):
    """`gate_up_silu` at a decode batch past the skinny GEMM's rows: on a Hopper GPU the stream-K
    kernel's one-wave form takes it, elsewhere cuBLAS and the SiLU kernel; the same result."""
    from ember.kernels.linear import LinearRouter
    from ember.kernels.tuning import LinearRoutes

    router = LinearRouter(LinearRoutes(stream_k_rows=(65, 128)))
    m, inter, k = 100, 256, 128
    x, weight = _inputs(gen, device, m, 2 * inter, k)
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    assert router.takes_stream_k(x, weight) == hopper
    assert not router.takes_stream_k(x[:64], weight), "below the routes' rows"
    assert not router.takes_stream_k(torch.cat([x, x]), weight), "past them: cuBLAS"
    out = router.gate_up_silu(x, weight)
    expected = gate_up_silu_reference(x.cpu().double(), weight.cpu().double())
    torch.testing.assert_close(out.cpu().double(), expected, atol=3e-2, rtol=3e-2)
