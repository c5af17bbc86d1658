"""The fused MoE kernels over FP8 experts (Triton's interpreter on a CPU): on both paths, for
routings that send every token to one expert or leave experts without any, they compute what
the float64 loop computes on the dequantized weights, and what the reference op computes on
the same operands; an FP8 operand without its scales is refused."""

from __future__ import annotations

import pytest
import torch
from helpers.moe_reference import (
    BY_PAIR,
    BY_PAIR_GEMV,
    BY_PAIR_SPLIT,
    GROUPED,
    GROUPED_ODD,
    assert_bf16_matches,
    moe_reference,
    moe_weights,
    routing,
)

from ember.kernels.fused_moe import fused_moe
from ember.layers.fp8 import Fp8Weight, dense_weight, quantize_rows
from ember.layers.reference_ops import moe_experts_reference

PATHS = {
    "by_pair": BY_PAIR,
    "by_pair_split": BY_PAIR_SPLIT,
    "by_pair_gemv": BY_PAIR_GEMV,
    "grouped": GROUPED,
    "grouped_odd": GROUPED_ODD,
}


def fp8_experts(stacked: torch.Tensor) -> Fp8Weight:
    """Stacked experts ``[E, N, K]`` quantized per expert and row, as a model holds them."""
    weight, scale = quantize_rows(stacked.reshape(-1, stacked.shape[-1]))
    return Fp8Weight(weight.view(stacked.shape), scale.view(stacked.shape[:2]))


def on(device, weight: Fp8Weight) -> Fp8Weight:
    return Fp8Weight(weight.weight.to(device), weight.scale.to(device))


def case(gen, *, tokens, num_experts, hidden, inter, top_k, kind, dtype, bias=False):
    """Inputs with FP8 experts, and the float64 reference on their dequantized weights."""
    weights = moe_weights(num_experts, hidden, inter, gen, torch.float32, bias)
    w13, w2 = fp8_experts(weights["w13"]), fp8_experts(weights["w2"])
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids, topk_weights = routing(kind, tokens, num_experts, top_k, gen)
    biases = {name: weights[name] for name in ("b13", "b2")}
    inputs = {"x": x, "w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": ids}
    expected = moe_reference(
        x,
        dense_weight(w13, torch.float64),
        dense_weight(w2, torch.float64),
        topk_weights,
        ids,
        activation="swiglu_oai" if bias else "silu",
        **biases,
    )
    return inputs, biases, expected


def run(device, inputs, biases, tiles, activation="silu"):
    on_device = {
        name: on(device, value) if isinstance(value, Fp8Weight) else value.to(device)
        for name, value in inputs.items()
    }
    biases = {name: b if b is None else b.to(device) for name, b in biases.items()}
    return fused_moe(**on_device, **biases, activation=activation, tiles=tiles).cpu()


def assert_matches(out, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    else:
        assert_bf16_matches(out, expected)


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
def test_fp8_experts_compute_their_dequantized_weights(gen, device, path, kind, tokens, top_k):
    hidden, inter = (72, 48) if path == "grouped_odd" else (64, 32)
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


@pytest.mark.parametrize("path", ["by_pair", "grouped"])
def test_bf16_activations_with_biases(gen, device, path):
    inputs, biases, expected = case(
        gen,
        tokens=9,
        num_experts=8,
        hidden=64,
        inter=64,
        top_k=2,
        kind="some_experts_empty",
        dtype=torch.bfloat16,
        bias=True,
    )
    out = run(device, inputs, biases, PATHS[path], activation="swiglu_oai")
    assert out.dtype == torch.bfloat16
    assert_matches(out, expected, torch.bfloat16)


@pytest.mark.parametrize("path", ["by_pair", "grouped"])
def test_the_kernels_and_the_reference_op_agree_on_fp8_experts(gen, device, path):
    """The Triton ops' ``moe_experts`` and the reference ops' (which dequantize each expert as
    they loop) on the same `Fp8Weight` operands."""
    inputs, biases, _ = case(
        gen,
        tokens=6,
        num_experts=8,
        hidden=64,
        inter=32,
        top_k=2,
        kind="some_experts_empty",
        dtype=torch.float32,
    )
    out = run(device, inputs, biases, PATHS[path])
    expected = moe_experts_reference(**inputs)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fp8_experts_need_their_scales():
    weights = moe_weights(4, 64, 32, torch.Generator().manual_seed(0))
    w13, w2 = fp8_experts(weights["w13"]), fp8_experts(weights["w2"])
    x = torch.zeros(2, 64)
    ids, topk_weights = torch.zeros(2, 2, dtype=torch.int32), torch.full((2, 2), 0.5)
    with pytest.raises(ValueError, match="needs its scales"):
        fused_moe(x, w13.weight, w2, topk_weights, ids)
    with pytest.raises(ValueError, match=r"w2's scales must be \[E, rows\]"):
        fused_moe(x, w13, Fp8Weight(w2.weight, w2.scale[:, :16]), topk_weights, ids)
    with pytest.raises(ValueError, match="float32 scales"):
        fused_moe(x, Fp8Weight(w13.weight, w13.scale.double()), w2, topk_weights, ids)
    with pytest.raises(ValueError, match="dtype"):  # FP8 gate/up, float down
        fused_moe(x, w13, weights["w2"], topk_weights, ids)


def test_fp8_experts_look_up_their_own_rows_on_the_heuristics_of_their_activations():
    """`moe_shape` marks FP8 experts (`MoeShape.fp8`): a table's rows for the bf16 experts of
    the same size do not serve them, nor theirs the bf16 ones; with no row of their own they
    take the bf16 heuristics' tiles (until a tune measures theirs)."""
    from dataclasses import replace

    from ember.kernels.fused_moe import moe_shape
    from ember.kernels.moe_tiles import MeasuredMoeTiles, MoeShape, MoeTuning, default_moe_tiles

    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    bf16 = torch.zeros(4, 2 * 96, 64, dtype=torch.bfloat16)
    fp8 = Fp8Weight(bf16.to(torch.float8_e4m3fn), torch.ones(4, 2 * 96))
    assert moe_shape(x, bf16, ids) == MoeShape(4, 64, 96, 2)
    assert moe_shape(x, fp8, ids) == MoeShape(4, 64, 96, 2, fp8=True)
    assert MoeShape(4, 64, 96, 2, fp8=True).weight_bytes == 1
    plain, quantized = MoeShape(128, 2048, 768, 8), MoeShape(128, 2048, 768, 8, fp8=True)
    for tokens in (1, 4, 16, 64, 256, 4096):
        assert default_moe_tiles(quantized, tokens) == default_moe_tiles(plain, tokens)
    measured = replace(default_moe_tiles(plain, 4), block_m=32)
    tuning = MoeTuning().with_measured(MeasuredMoeTiles(plain, 8, measured))
    assert tuning.tiles_for(plain, 4) == measured
    assert tuning.tiles_for(quantized, 4) == default_moe_tiles(quantized, 4)
    tuning = MoeTuning().with_measured(MeasuredMoeTiles(quantized, 8, measured))
    assert tuning.tiles_for(quantized, 4) == measured
    assert tuning.tiles_for(plain, 4) == default_moe_tiles(plain, 4)


def test_fp8_tiles_widen_in_ptx_where_compiled_on_bf16_and_asked(monkeypatch):
    """`weight_format`: FP8 experts on bf16 activations widen in PTX (`W_FP8_PTX`) when asked
    and compiled; on other activations, in the interpreter (no PTX) or unasked, by Triton's
    conversions. The engine's switch reaches the MoE table (`KernelTuning.for_device`)."""
    from ember.kernels import moe_gemm
    from ember.kernels.moe_gemm import W_FP8, W_FP8_PTX, W_PLAIN, weight_format
    from ember.kernels.tuning import KernelTuning

    weight = torch.zeros(2, 4, 32, dtype=torch.float8_e4m3fn)
    scale = torch.ones(2, 4)
    assert weight_format(weight, scale, torch.bfloat16, fp8_in_registers=True) == W_FP8
    monkeypatch.setattr(moe_gemm, "widens_in_registers", lambda requested: requested)
    assert weight_format(weight, scale, torch.bfloat16, fp8_in_registers=True) == W_FP8_PTX
    assert weight_format(weight, scale, torch.bfloat16) == W_FP8
    assert weight_format(weight, scale, torch.float32, fp8_in_registers=True) == W_FP8
    assert weight_format(weight.float(), None, torch.float32, fp8_in_registers=True) == W_PLAIN
    cpu = torch.device("cpu")
    assert KernelTuning.for_device(cpu).moe.fp8_widen_in_registers
    off = KernelTuning.for_device(cpu, fp8_widen_in_registers=False)
    assert not off.moe.fp8_widen_in_registers
