"""The fused MoE kernels against a float64 loop over the experts (Triton's interpreter on a
CPU): both paths (by pair, grouped), routings that leave experts empty or send every token to
one, both activations, biases, fp32 and bf16; and the op as the Triton ops expose it."""

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
from ember.kernels.moe_tiles import MoeShape, MoeTuning, default_moe_tiles
from ember.kernels.tuning import KernelTuning
from ember.layers.ops import triton_ops

PATHS = {
    "by_pair": BY_PAIR,
    "by_pair_split": BY_PAIR_SPLIT,
    "by_pair_gemv": BY_PAIR_GEMV,
    "grouped": GROUPED,
}


def run_case(
    gen,
    device,
    *,
    tokens,
    num_experts,
    hidden,
    inter,
    top_k,
    kind="random",
    activation="silu",
    bias=False,
    dtype=torch.float32,
    tiles=None,
    tuning=None,
):
    """The kernel's output and the reference's (float64, from the same rounded operands)."""
    weights = moe_weights(num_experts, hidden, inter, gen, dtype, bias)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    topk_ids, topk_weights = routing(kind, tokens, num_experts, top_k, gen)
    expected = moe_reference(
        x, **weights, topk_weights=topk_weights, topk_ids=topk_ids, activation=activation
    )
    on_device = {name: t if t is None else t.to(device) for name, t in weights.items()}
    out = fused_moe(
        x.to(device),
        topk_weights=topk_weights.to(device),
        topk_ids=topk_ids.to(device),
        activation=activation,
        tiles=tiles,
        tuning=tuning,
        **on_device,
    )
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    return out.cpu().double(), expected


def assert_matches(out, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    else:
        assert_bf16_matches(out, expected)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(
    ("kind", "tokens", "top_k"),
    [
        ("random", 5, 2),
        ("one_expert", 6, 1),  # every token on one expert: by pair, all read its rows
        ("one_expert", 3, 2),
        ("some_experts_empty", 7, 2),
    ],
)
def test_routings_on_each_path(gen, device, path, kind, tokens, top_k):
    out, expected = run_case(
        gen,
        device,
        tokens=tokens,
        num_experts=8,
        hidden=64,
        inter=32,
        top_k=top_k,
        kind=kind,
        tiles=PATHS[path],
    )
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize(
    ("kind", "tokens", "top_k", "tiles"),
    [
        ("random", 40, 2, GROUPED),  # several blocks an expert
        ("one_expert", 40, 1, GROUPED),  # one expert's 3 blocks, k = 1 written directly
        ("some_experts_empty", 33, 2, GROUPED_ODD),
        ("random", 12, 4, GROUPED_ODD),
    ],
)
def test_grouped_blocks_of_many_rows(gen, device, kind, tokens, top_k, tiles):
    hidden, inter = (64, 32) if tiles is GROUPED else (72, 48)
    out, expected = run_case(
        gen,
        device,
        tokens=tokens,
        num_experts=12,
        hidden=hidden,
        inter=inter,
        top_k=top_k,
        kind=kind,
        tiles=tiles,
    )
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_activations_with_biases(gen, device, path, activation):
    out, expected = run_case(
        gen,
        device,
        tokens=4,
        num_experts=6,
        hidden=64,
        inter=32,
        top_k=2,
        activation=activation,
        bias=True,
        tiles=PATHS[path],
    )
    assert_matches(out, expected, torch.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid
def test_swiglu_oai_clamps_gate_and_up(gen, device):
    """Large activations cross gpt-oss's limits (gate <= 7, |up| <= 7) on both sides."""
    weights = moe_weights(4, 64, 32, gen, bias=True)
    weights["w13"] *= 20
    x = torch.randn(3, 64, generator=gen)
    topk_ids, topk_weights = routing("random", 3, 4, 2, gen)
    gate_up = torch.einsum("th,eih->tei", x.double(), weights["w13"].double())
    assert (gate_up > 7).any() and (gate_up < -7).any()
    expected = moe_reference(
        x, **weights, topk_weights=topk_weights, topk_ids=topk_ids, activation="swiglu_oai"
    )
    on_device = {name: t.to(device) for name, t in weights.items()}
    for tiles in PATHS.values():
        out = fused_moe(
            x.to(device),
            **on_device,
            topk_weights=topk_weights.to(device),
            topk_ids=topk_ids.to(device),
            activation="swiglu_oai",
            tiles=tiles,
        )
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_bf16(gen, device, path):
    out, expected = run_case(
        gen,
        device,
        tokens=9,
        num_experts=8,
        hidden=64,
        inter=64,
        top_k=2,
        activation="swiglu_oai",
        bias=True,
        dtype=torch.bfloat16,
        tiles=PATHS[path],
    )
    assert_matches(out, expected, torch.bfloat16)


def test_one_token_on_the_default_table(gen, device):
    """T = 1, as a decode step at batch 1 runs it: the table's by-pair tiles."""
    shape = MoeShape(8, 64, 32, 2, 4)
    assert default_moe_tiles(shape, 1).by_pair
    out, expected = run_case(gen, device, tokens=1, num_experts=8, hidden=64, inter=32, top_k=2)
    assert_matches(out, expected, torch.float32)


def test_the_torch_alignment_path(gen, device):
    tuning = MoeTuning(by_pair_max_tokens=0, align_kernel_max_pairs=0)
    out, expected = run_case(
        gen,
        device,
        tokens=20,
        num_experts=8,
        hidden=64,
        inter=32,
        top_k=2,
        kind="some_experts_empty",
        tuning=tuning,
    )
    assert_matches(out, expected, torch.float32)


def test_paths_agree_on_the_same_inputs(gen, device):
    """Both paths round the same way: on one input, far closer to each other than to the
    float64 reference's tolerance."""
    weights = {
        k: v if v is None else v.to(device)
        for k, v in moe_weights(8, 64, 32, gen, torch.bfloat16, bias=True).items()
    }
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16).to(device)
    topk_ids, topk_weights = (t.to(device) for t in routing("random", 5, 8, 3, gen))
    outs = [
        fused_moe(x, **weights, topk_weights=topk_weights, topk_ids=topk_ids, tiles=tiles)
        for tiles in (BY_PAIR, GROUPED)
    ]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-2, rtol=8e-3)


def test_no_tokens():
    weights = moe_weights(4, 64, 32, torch.Generator().manual_seed(0))
    out = fused_moe(
        torch.empty(0, 64),
        **weights,
        topk_weights=torch.empty(0, 2),
        topk_ids=torch.empty(0, 2, dtype=torch.int32),
    )
    assert out.shape == (0, 64)


def test_operands_are_checked():
    weights = moe_weights(4, 64, 32, torch.Generator().manual_seed(0))
    x = torch.zeros(2, 64)
    ids, w = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, **weights, topk_weights=w, topk_ids=ids, activation="gelu")
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, weights["w13"], weights["w2"][:, :, :16], w, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, weights["w13"], weights["w2"], w[:1], ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x.double(), weights["w13"], weights["w2"], w, ids)


def test_triton_ops_run_the_fused_moe_on_the_device_table(gen, device):
    """`Ops.moe_experts` of the Triton ops: the contract's signature, on the tuning's table."""
    tuning = KernelTuning(moe=MoeTuning(by_pair_max_tokens=0))
    ops = triton_ops(tuning=tuning)
    assert ops.moe_experts.keywords["tuning"] is tuning.moe
    weights = moe_weights(6, 64, 32, gen, bias=True)
    x = torch.randn(7, 64, generator=gen)
    topk_ids, topk_weights = routing("random", 7, 6, 2, gen)
    out = ops.moe_experts(
        x.to(device),
        weights["w13"].to(device),
        weights["w2"].to(device),
        topk_weights.to(device),
        topk_ids.to(device),
        "swiglu_oai",
        b13=weights["b13"].to(device),
        b2=weights["b2"].to(device),
    )
    expected = moe_reference(
        x, **weights, topk_weights=topk_weights, topk_ids=topk_ids, activation="swiglu_oai"
    )
    assert_matches(out.cpu().double(), expected, torch.float32)
