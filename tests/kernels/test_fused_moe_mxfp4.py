"""The fused MoE kernels over MXFP4 experts (Triton's interpreter on a CPU): a packed tile
decodes to exactly the values `dequantize_mxfp4` gives, every code at every kind of scale; on
both paths, for routings that send every token to one expert or leave experts without any, at K
steps that do and do not divide H and I, the kernels compute what the float64 loop computes on
the dequantized weights (biases and the clamped SwiGLU too), and what the reference op computes
on the same operands; operands that do not pair are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from helpers.moe_reference import BY_PAIR_GEMV, moe_reference, moe_weights, routing

from ember.kernels.compile_ahead import kernels_interpreted
from ember.kernels.fused_moe import fused_moe
from ember.kernels.moe_gemm import W_MXFP4
from ember.kernels.moe_gemv import _gemv_tile
from ember.kernels.moe_tiles import GemmTiles, MoeTiles
from ember.kernels.mxfp4 import mxfp4_tile, mxfp4_tile_k_major
from ember.layers.mxfp4 import Mxfp4Weight
from ember.layers.reference_ops import moe_experts_reference
from ember.weights.mxfp4 import dequantize_mxfp4, quantize_mxfp4

BY_PAIR = MoeTiles(True, 16, GemmTiles(16, 32, 2, 4), GemmTiles(32, 64, 2, 4))
GROUPED = MoeTiles(False, 16, GemmTiles(32, 64, 2, 4), GemmTiles(32, 32, 2, 4, group_m=2))
# Rows of 32, column tiles past I and H, K steps that do not divide H or I.
GROUPED_ODD = MoeTiles(False, 32, GemmTiles(32, 64, 2, 4, group_m=3), GemmTiles(64, 64, 2, 4))
# By pair with down one program per pair, and the sum over k after.
BY_PAIR_SPLIT = replace(BY_PAIR, down_by_token=False)
PATHS = {
    "by_pair": BY_PAIR,
    "by_pair_split": BY_PAIR_SPLIT,
    "by_pair_gemv": BY_PAIR_GEMV,
    "grouped": GROUPED,
    "grouped_odd": GROUPED_ODD,
}


@triton.jit
def _decode_kernel(blocks_ptr, scales_ptr, out_ptr, K: tl.constexpr, ROWS: tl.constexpr):
    """The [ROWS, K] tile of packed rows decoded by `mxfp4_tile`, stored in order."""
    rows = tl.arange(0, ROWS)[:, None]
    even, odd = mxfp4_tile(
        blocks_ptr + rows * (K // 2), scales_ptr + rows * (K // 32), 0, K, out_ptr.dtype.element_ty,
        True, K,
    )  # fmt: skip
    cols = tl.arange(0, K // 2)[None, :]
    tl.store(out_ptr + rows * K + 2 * cols, even)
    tl.store(out_ptr + rows * K + 2 * cols + 1, odd)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 6 * 2^127 is infinite, as it is
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_tile_decodes_to_the_dequantized_values(device, dtype):
    """Every pair of codes (all 256 bytes) under scales from 2^-127 (e8m0's smallest, a float32
    subnormal) to 2^127."""
    scales = torch.tensor([0, 1, 100, 120, 127, 128, 140, 254], dtype=torch.uint8)
    rows, k = len(scales), 512  # a row: 256 bytes, each of the 256 byte values once
    blocks = torch.arange(256, dtype=torch.uint8).repeat(rows, 1).view(rows, k // 32, 16)
    group_scales = scales[:, None].expand(rows, k // 32).contiguous()
    out = torch.empty(rows, k, dtype=dtype, device=device)
    _decode_kernel[(1,)](blocks.to(device), group_scales.to(device), out, K=k, ROWS=rows)
    expected = dequantize_mxfp4(blocks, group_scales, dtype)
    assert torch.equal(out.cpu().view(torch.uint8), expected.view(torch.uint8))  # bit for bit


@triton.jit
def _decode_k_major_kernel(blocks_ptr, scales_ptr, out_ptr, K: tl.constexpr, ROWS: tl.constexpr):
    """The [ROWS, K] tile of packed rows decoded by `mxfp4_tile_k_major` ([K / 2, ROWS] even
    and odd columns), stored in row order."""
    rows = tl.arange(0, ROWS)[None, :]
    even, odd = mxfp4_tile_k_major(
        blocks_ptr + rows * (K // 2), scales_ptr + rows * (K // 32), 0, K, True, K
    )
    cols = tl.arange(0, K // 2)[:, None]
    tl.store(out_ptr + rows * K + 2 * cols, even)
    tl.store(out_ptr + rows * K + 2 * cols + 1, odd)


@pytest.mark.skipif(kernels_interpreted(), reason="PTX: compiled kernels only (a GPU)")
def test_a_packed_tile_decodes_in_ptx_to_the_dequantized_values(device):
    """The PTX decode (K-major, bf16), as `mxfp4_tile`'s test: every byte at every kind of
    scale, bit for bit."""
    scales = torch.tensor([0, 1, 100, 120, 127, 128, 140, 254], dtype=torch.uint8)
    rows, k = len(scales), 512
    blocks = torch.arange(256, dtype=torch.uint8).repeat(rows, 1).view(rows, k // 32, 16)
    group_scales = scales[:, None].expand(rows, k // 32).contiguous()
    out = torch.empty(rows, k, dtype=torch.bfloat16, device=device)
    _decode_k_major_kernel[(1,)](blocks.to(device), group_scales.to(device), out, K=k, ROWS=rows)
    expected = dequantize_mxfp4(blocks, group_scales, torch.bfloat16)
    assert torch.equal(out.cpu().view(torch.uint8), expected.view(torch.uint8))


def mxfp4_experts(stacked: torch.Tensor) -> Mxfp4Weight:
    """Stacked experts ``[E, N, K]`` quantized to MXFP4, as a model holds them."""
    return Mxfp4Weight(*quantize_mxfp4(stacked))


def on(device, value):
    if isinstance(value, Mxfp4Weight):
        return Mxfp4Weight(value.blocks.to(device), value.scales.to(device))
    return value if value is None else value.to(device)


def case(gen, *, tokens, num_experts, hidden, inter, top_k, kind, dtype, bias=False):
    """Inputs with MXFP4 experts, and the float64 reference on their dequantized weights."""
    weights = moe_weights(num_experts, hidden, inter, gen, torch.float32, bias)
    w13, w2 = mxfp4_experts(weights["w13"]), mxfp4_experts(weights["w2"])
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids, topk_weights = routing(kind, tokens, num_experts, top_k, gen)
    biases = {name: on("cpu", weights[name]) for name in ("b13", "b2")}
    if bias:
        biases = {name: b.to(dtype) for name, b in biases.items()}
    inputs = {"x": x, "w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": ids}
    expected = moe_reference(
        x,
        w13.dequantize(torch.float64),
        w2.dequantize(torch.float64),
        topk_weights,
        ids,
        activation="swiglu_oai" if bias else "silu",
        **biases,
    )
    return inputs, biases, expected


def run(device, inputs, biases, tiles, activation="silu"):
    on_device = {name: on(device, value) for name, value in {**inputs, **biases}.items()}
    return fused_moe(**on_device, activation=activation, tiles=tiles).cpu()


def assert_matches(out, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    else:  # gate, up, the activation, each expert's output and its weighted copy rounded
        torch.testing.assert_close(out.double(), expected, atol=6e-2, rtol=3e-2)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(
    ("kind", "tokens", "top_k"),
    [
        ("random", 5, 2),
        ("one_expert", 6, 1),  # every token on one expert; the others get none
        ("one_expert", 3, 2),
        ("some_experts_empty", 33, 2),
    ],
)
def test_mxfp4_experts_compute_their_dequantized_weights(gen, device, path, kind, tokens, top_k):
    hidden, inter = (96, 160) if path == "grouped_odd" else (64, 32)
    inputs, biases, expected = case(
        gen,
        tokens=tokens,
        num_experts=8,
        hidden=hidden,
        inter=inter,
        top_k=top_k,
        kind=kind,
        dtype=torch.float32,
    )
    out = run(device, inputs, biases, PATHS[path])
    assert out.dtype == torch.float32 and out.shape == (tokens, hidden)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_bf16_activations_with_biases_and_the_clamped_swiglu(gen, device, path):
    """gpt-oss's experts: biases on both products, the clamped SwiGLU, bf16 activations."""
    hidden, inter = (96, 160) if path == "grouped_odd" else (64, 64)
    inputs, biases, expected = case(
        gen,
        tokens=9,
        num_experts=8,
        hidden=hidden,
        inter=inter,
        top_k=2,
        kind="some_experts_empty",
        dtype=torch.bfloat16,
        bias=True,
    )
    assert all(b.abs().sum() > 0 for b in biases.values())
    out = run(device, inputs, biases, PATHS[path], activation="swiglu_oai")
    assert out.dtype == torch.bfloat16
    assert_matches(out, expected, torch.bfloat16)


@pytest.mark.parametrize("path", ["by_pair", "grouped"])
def test_the_kernels_and_the_reference_op_agree_on_mxfp4_experts(gen, device, path):
    """The Triton ops' ``moe_experts`` and the reference ops' (which dequantize each expert as
    they loop) on the same `Mxfp4Weight` operands."""
    inputs, biases, _ = case(
        gen,
        tokens=6,
        num_experts=8,
        hidden=64,
        inter=32,
        top_k=2,
        kind="some_experts_empty",
        dtype=torch.float32,
        bias=True,
    )
    out = run(device, inputs, biases, PATHS[path], activation="swiglu_oai")
    expected = moe_experts_reference(**inputs, **biases, activation="swiglu_oai")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_the_default_tiles_run_mxfp4_experts(gen, device):
    """No tiles given: the heuristics' for the MXFP4 shape, at a decode and a prefill size."""
    for tokens in (1, 40):
        inputs, biases, expected = case(
            gen, tokens=tokens, num_experts=4, hidden=96, inter=64, top_k=2, kind="random",
            dtype=torch.float32,
        )  # fmt: skip
        assert_matches(run(device, inputs, biases, None), expected, torch.float32)


def test_mxfp4_operands_that_do_not_pair_are_refused():
    weights = moe_weights(4, 64, 32, torch.Generator().manual_seed(0))
    w13, w2 = mxfp4_experts(weights["w13"]), mxfp4_experts(weights["w2"])
    x = torch.zeros(2, 64)
    ids, topk_weights = torch.zeros(2, 2, dtype=torch.int32), torch.full((2, 2), 0.5)
    with pytest.raises(ValueError, match="dtype"):  # MXFP4 gate/up, float down
        fused_moe(x, w13, weights["w2"], topk_weights, ids)
    with pytest.raises(ValueError, match=r"scales \[E, rows, K/32\]"):
        fused_moe(x, Mxfp4Weight(w13.blocks, w13.scales[:, :, :1]), w2, topk_weights, ids)
    with pytest.raises(ValueError, match="uint8"):
        fused_moe(x, Mxfp4Weight(w13.blocks, w13.scales.float()), w2, topk_weights, ids)
    with pytest.raises(ValueError, match=r"want w13 \[E, 2I, 64\]"):  # K of 32, not 64
        fused_moe(x, Mxfp4Weight(w13.blocks[:, :, :1], w13.scales[:, :, :1]), w2, topk_weights, ids)
    with pytest.raises(ValueError, match="whole 32-value groups"):
        tiles = MoeTiles(True, 16, GemmTiles(16, 16, 2, 4), GemmTiles(16, 32, 2, 4))
        fused_moe(x, w13, w2, topk_weights, ids, tiles=tiles)


@triton.jit
def _gemv_group_sums_kernel(
    blocks_ptr,
    scales_ptr,
    x_ptr,
    out_ptr,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    W_FORMAT: tl.constexpr,
):
    """The GEMV step's ``[ROWS, K / 32]`` group sums of packed rows against ``x``."""
    rows = tl.arange(0, ROWS)[:, None]
    acc = tl.zeros([ROWS, K // 32], dtype=tl.float32)
    acc = _gemv_tile(
        acc, x_ptr, blocks_ptr + rows * (K // 2), scales_ptr + rows * (K // 32), 0, K,
        W_FORMAT, True, K,
    )  # fmt: skip
    tl.store(out_ptr + rows * (K // 32) + tl.arange(0, K // 32)[None, :], acc)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 6 * 2^97 * 2^30 is infinite
def test_the_gemv_step_decodes_every_code_at_every_scale_it_takes(device):
    """Every byte value under scales from 2^-127 to 2^97 (e8m0 byte 224, the largest the GEMV
    takes): against a one-hot activation at one place of every group, each group's sum is the
    dequantized value there (a byte past 224 reads as infinite)."""
    scales = torch.tensor([0, 1, 100, 120, 127, 128, 140, 224], dtype=torch.uint8)
    rows, k = len(scales), 512
    blocks = torch.arange(256, dtype=torch.uint8).repeat(rows, 1).view(rows, k // 32, 16)
    group_scales = scales[:, None].expand(rows, k // 32).contiguous()
    expected = dequantize_mxfp4(blocks, group_scales, torch.float32).view(rows, k // 32, 32)
    blocks, group_scales = blocks.to(device), group_scales.to(device)
    out = torch.empty(rows, k // 32, device=device)

    def group_sums(scales: torch.Tensor, place: int) -> torch.Tensor:
        x = torch.zeros(k // 32, 32, device=device)
        x[:, place] = 1.0
        _gemv_group_sums_kernel[(1,)](
            blocks, scales, x.view(-1), out, K=k, ROWS=rows, W_FORMAT=W_MXFP4
        )
        return out.cpu()

    for place in range(32):
        assert torch.equal(group_sums(group_scales, place), expected[:, :, place]), place
    out = group_sums(torch.full_like(group_scales, 225), 2)  # each group's byte 1: code 0.5
    assert torch.isposinf(out).all()
