"""The fused MoE kernels compiled on the GPU: bf16 at the gpt-oss-20b and Qwen3-30B-A3B expert
shapes against the plain reference, on both paths and each block size the table picks, over
bf16 and FP8 experts (and Llama-4-Scout's FP8 experts fed router-scaled inputs); and a
CUDA graph captured once and replayed under routings that change between replays (one that
sends every token to one expert among them).

Skipped without a CUDA GPU; `tools/gpu_run.sh` runs these on the H200.
"""

from __future__ import annotations

import pytest
import torch
from helpers.moe_reference import moe_reference

from ember.bench.tune_moe import MOE_SHAPES, expert_weights
from ember.kernels.fused_moe import fused_moe
from ember.kernels.moe_tiles import MoeShape, MoeTuning, gemv_moe_tiles
from ember.layers.fp8 import Fp8Weight, dense_weight, quantize_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


# The shapes in bf16 (the MXFP4 ones: tests/gpu/test_gpu_fused_moe_mxfp4.py; FP8 experts:
# tests/gpu/test_gpu_fp8_weights.py and the CPU tests of the sweep).
BF16_SHAPES = sorted(n for n, shape in MOE_SHAPES.items() if not (shape.mxfp4 or shape.fp8))


@pytest.fixture(scope="module", params=BF16_SHAPES)
def experts(request):
    """(shape, weights with biases for gpt-oss, activation) on the GPU, made once a shape."""
    shape = MOE_SHAPES[request.param]
    weights = expert_weights(shape, seed=1)
    gpt_oss = request.param.startswith("gpt-oss")
    if gpt_oss:
        g = torch.Generator(device="cuda").manual_seed(2)
        e, h, i = shape.num_experts, shape.hidden, shape.intermediate
        weights["b13"] = (torch.randn(e, 2 * i, generator=g, device="cuda") / 4).bfloat16()
        weights["b2"] = (torch.randn(e, h, generator=g, device="cuda") / 4).bfloat16()
    yield shape, weights, "swiglu_oai" if gpt_oss else "silu"
    del weights
    torch.cuda.empty_cache()


def random_routing(tokens: int, num_experts: int, top_k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=g, device="cuda")
    weights, ids = scores.softmax(1).topk(top_k, dim=1)
    return ids.to(torch.int32), weights / weights.sum(1, keepdim=True)


def assert_near_reference(out, x, weights, topk_ids, topk_weights, activation):
    expected = moe_reference(
        x,
        **weights,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        activation=activation,
        compute_dtype=torch.float32,
    )
    error = (out.float() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e}"
    torch.testing.assert_close(out.float(), expected, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("tokens", [1, 3, 24, 300])
def test_bf16_matches_the_reference_on_the_default_table(experts, tokens):
    """T = 1 and 3 take the by-pair path, 24 grouped on 16-row blocks, 300 on larger ones."""
    shape, weights, activation = experts
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, generator=g, device="cuda").bfloat16()
    topk_ids, topk_weights = random_routing(tokens, shape.num_experts, shape.top_k, tokens)
    out = fused_moe(
        x, **weights, topk_weights=topk_weights, topk_ids=topk_ids, activation=activation
    )
    assert_near_reference(out, x, weights, topk_ids, topk_weights, activation)


@pytest.mark.parametrize("form", ["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_the_gemv_path_matches_the_reference(experts, tokens, form):
    """The by-pair products on the CUDA cores (`MoeTiles.gemv`), compiled, on bf16 and FP8
    experts."""
    shape, weights, activation = experts
    if form == "fp8":
        fp8 = {"w13": fp8_experts(weights["w13"]), "w2": fp8_experts(weights["w2"])}
        operands = {**weights, **fp8}
        weights = {**weights, **{k: dense_weight(w, torch.float32) for k, w in fp8.items()}}
    else:
        operands = weights
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, generator=g, device="cuda").bfloat16()
    topk_ids, topk_weights = random_routing(tokens, shape.num_experts, shape.top_k, tokens)
    tiles = gemv_moe_tiles(shape, tokens)
    out = fused_moe(
        x, **operands, topk_weights=topk_weights, topk_ids=topk_ids, activation=activation,
        tiles=tiles,
    )  # fmt: skip
    assert_near_reference(out, x, weights, topk_ids, topk_weights, activation)


@pytest.mark.parametrize("tokens", [1, 24, 300])
def test_fp8_experts_match_the_reference_on_their_dequantized_weights(experts, tokens):
    """FP8 experts (a scale per expert and row) on each path: the bf16 activations against the
    reference on the weights they stand for."""
    shape, weights, activation = experts
    fp8 = {**weights, "w13": fp8_experts(weights["w13"]), "w2": fp8_experts(weights["w2"])}
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, generator=g, device="cuda").bfloat16()
    topk_ids, topk_weights = random_routing(tokens, shape.num_experts, shape.top_k, tokens)
    out = fused_moe(x, **fp8, topk_weights=topk_weights, topk_ids=topk_ids, activation=activation)
    dequantized = {
        **weights,
        "w13": dense_weight(fp8["w13"], torch.float32),
        "w2": dense_weight(fp8["w2"], torch.float32),
    }
    assert_near_reference(out, x, dequantized, topk_ids, topk_weights, activation)


@pytest.mark.parametrize("tokens", [1, 24, 300])
def test_fp8_experts_widened_in_ptx_compute_what_the_conversions_compute(experts, tokens):
    """`MoeTuning.fp8_widen_in_registers` (the default): FP8 expert tiles widened to bf16 by
    their bits in PTX give exactly the outputs of Triton's conversions, on each path."""
    shape, weights, activation = experts
    fp8 = {**weights, "w13": fp8_experts(weights["w13"]), "w2": fp8_experts(weights["w2"])}
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, generator=g, device="cuda").bfloat16()
    topk_ids, topk_weights = random_routing(tokens, shape.num_experts, shape.top_k, tokens)
    routed = {"topk_weights": topk_weights, "topk_ids": topk_ids, "activation": activation}
    outs = [
        fused_moe(x, **fp8, **routed, tuning=MoeTuning(fp8_widen_in_registers=in_ptx))
        for in_ptx in (False, True)
    ]
    assert torch.equal(outs[0], outs[1])


# Llama-4-Scout-17B-16E's experts: 16 of [2 x 8192, 5120], one a token (`make-model`'s preset).
SCOUT = MoeShape(num_experts=16, hidden=5120, intermediate=8192, top_k=1)


@pytest.mark.parametrize("tokens", [1, 24, 300])
def test_fp8_llama4_scout_experts_take_router_scaled_inputs(tokens):
    """Llama 4 as its MoE block calls the op: each token scaled by its top-1 score (the sigmoid
    of its router logit, in bf16), weights of 1; Scout's FP8 experts on each path against the
    reference on their dequantized weights."""
    weights = expert_weights(SCOUT, seed=3)
    fp8 = {"w13": fp8_experts(weights.pop("w13")), "w2": fp8_experts(weights.pop("w2"))}
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, SCOUT.hidden, generator=g, device="cuda").bfloat16()
    logits = torch.randn(tokens, SCOUT.num_experts, generator=g, device="cuda").bfloat16()
    top, topk_ids = logits.topk(1, dim=-1)
    scaled = x * torch.sigmoid(top.float()).to(x.dtype)
    ones = torch.ones(tokens, 1, device="cuda")
    out = fused_moe(scaled, **fp8, topk_weights=ones, topk_ids=topk_ids.to(torch.int32))
    dequantized = {name: dense_weight(weight, torch.float32) for name, weight in fp8.items()}
    assert_near_reference(out, scaled, dequantized, topk_ids.to(torch.int32), ones, "silu")
    del fp8, dequantized
    torch.cuda.empty_cache()


def fp8_experts(stacked: torch.Tensor) -> Fp8Weight:
    weight, scale = quantize_rows(stacked.reshape(-1, stacked.shape[-1]))
    return Fp8Weight(weight.view(stacked.shape), scale.view(stacked.shape[:2]))


@pytest.mark.parametrize("by_pair_max_tokens", [8, 0])
def test_a_captured_graph_follows_the_routing_of_each_replay(experts, by_pair_max_tokens):
    """One capture at 8 tokens (by pair, then grouped), replayed under three routings written
    into its input buffers: random, every token on the same k experts, and random again."""
    shape, weights, activation = experts
    tokens, k = 8, shape.top_k
    tuning = MoeTuning(by_pair_max_tokens=by_pair_max_tokens)
    x = torch.randn(tokens, shape.hidden, device="cuda").bfloat16()
    topk_ids, topk_weights = random_routing(tokens, shape.num_experts, k, seed=0)

    def run():
        return fused_moe(
            x,
            **weights,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            activation=activation,
            tuning=tuning,
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()

    one_expert = torch.arange(k, dtype=torch.int32, device="cuda").expand(tokens, k) + 3
    routings = [
        random_routing(tokens, shape.num_experts, k, seed=1),
        (one_expert, torch.full((tokens, k), 1.0 / k, device="cuda")),
        random_routing(tokens, shape.num_experts, k, seed=2),
    ]
    for ids, routing_weights in routings:
        topk_ids.copy_(ids)
        topk_weights.copy_(routing_weights)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert_near_reference(out, x, weights, topk_ids, topk_weights, activation)
        torch.testing.assert_close(out, run(), atol=0, rtol=0)  # the eager launch's bits
