"""The fused MoE's MXFP4 variant compiled on the GPU: gpt-oss-20b's experts packed as its
checkpoint holds them, on both paths and each block size the table picks, against the plain
reference on the dequantized weights (biases and the clamped SwiGLU included) and against the
same kernels on those weights in bf16; each way of decoding the tiles (`tl.dot_scaled`, in
registers, the GEMV's); and a CUDA graph replayed under changing routings.

Skipped without a CUDA GPU; `tools/gpu_run.sh` runs these (stage tests, or moe).
"""

from __future__ import annotations

import pytest
import torch
from helpers.moe_reference import moe_reference

from ember.bench.tune_moe import MOE_SHAPES, expert_weights
from ember.kernels.fused_moe import fused_moe
from ember.kernels.moe_tiles import MoeTuning

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = MOE_SHAPES["gpt-oss-20b-mxfp4"]


@pytest.fixture(scope="module")
def experts():
    """Packed weights, their bf16 dequantization, and biases, on the GPU."""
    packed = expert_weights(SHAPE, seed=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    e, h, i = SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate
    biases = {
        "b13": (torch.randn(e, 2 * i, generator=g, device="cuda") / 4).bfloat16(),
        "b2": (torch.randn(e, h, generator=g, device="cuda") / 4).bfloat16(),
    }
    dense = {name: w.dequantize(torch.bfloat16) for name, w in packed.items()}
    yield packed, dense, biases
    del packed, dense
    torch.cuda.empty_cache()


def random_routing(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, SHAPE.num_experts, generator=g, device="cuda")
    weights, ids = scores.softmax(1).topk(SHAPE.top_k, dim=1)
    return ids.to(torch.int32), weights / weights.sum(1, keepdim=True)


@pytest.mark.parametrize("tokens", [1, 3, 24, 300])
def test_mxfp4_experts_match_the_reference_and_bf16_on_the_default_table(experts, tokens):
    """T = 1 and 3 take the by-pair path, 24 grouped on 16-row blocks, 300 on larger ones."""
    packed, dense, biases = experts
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, SHAPE.hidden, generator=g, device="cuda").bfloat16()
    ids, weights = random_routing(tokens, tokens)
    routed = {"topk_weights": weights, "topk_ids": ids, "activation": "swiglu_oai", **biases}
    out = fused_moe(x, **packed, **routed)
    expected = moe_reference(x, **dense, **routed, compute_dtype=torch.float32)
    error = (out.float() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e}"
    # The same weights in bf16 through the bf16 kernels: the same products, other tiles.
    widened = fused_moe(x, **dense, **routed)
    torch.testing.assert_close(out, widened, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("by_pair_max_tokens", [8, 0])
def test_a_captured_graph_of_mxfp4_experts_follows_each_replays_routing(
    experts, by_pair_max_tokens
):
    packed, dense, biases = experts
    tokens, k = 8, SHAPE.top_k
    tuning = MoeTuning(by_pair_max_tokens=by_pair_max_tokens)
    x = torch.randn(tokens, SHAPE.hidden, device="cuda").bfloat16()
    ids, weights = random_routing(tokens, seed=0)

    def run():
        return fused_moe(
            x, **packed, topk_weights=weights, topk_ids=ids, activation="swiglu_oai",
            tuning=tuning, **biases,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    one_expert = torch.arange(k, dtype=torch.int32, device="cuda").expand(tokens, k) + 3
    for new_ids, new_weights in (
        random_routing(tokens, seed=1),
        (one_expert, torch.full((tokens, k), 1.0 / k, device="cuda")),
    ):
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, run(), atol=0, rtol=0)  # the eager launch's bits
        expected = moe_reference(
            x, **dense, topk_weights=weights, topk_ids=ids, activation="swiglu_oai",
            compute_dtype=torch.float32, **biases,
        )  # fmt: skip
        assert (out.float() - expected).norm() / expected.norm() < 1e-2


@pytest.mark.parametrize("path", ["by_pair", "by_pair_gemv", "grouped"])
@pytest.mark.parametrize("tokens", [1, 3, 300])
def test_every_decode_of_mxfp4_experts_computes_the_same_products(experts, path, tokens):
    """Compiled, each way a product can decode MXFP4 tiles: `tl.dot_scaled` (the heuristics'),
    the register decode on the tensor cores, and the GEMV's on the CUDA cores all give the
    reference's result on the dequantized weights, and the tensor-core two the same bits as far
    as their dots' summation orders allow."""
    from dataclasses import replace

    from ember.kernels.moe_tiles import by_pair_moe_tiles, default_moe_tiles

    packed, dense, biases = experts
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, SHAPE.hidden, generator=g, device="cuda").bfloat16()
    ids, weights = random_routing(tokens, tokens)
    routed = {"topk_weights": weights, "topk_ids": ids, "activation": "swiglu_oai", **biases}
    if path == "grouped":
        scaled = default_moe_tiles(SHAPE, tokens, MoeTuning(by_pair_max_tokens=0))
    else:
        scaled = by_pair_moe_tiles(SHAPE, tokens)
    registers = replace(
        scaled,
        gate_up=replace(scaled.gate_up, mxfp4_in_registers=True),
        down=replace(scaled.down, mxfp4_in_registers=True),
    )
    expected = moe_reference(x, **dense, **routed, compute_dtype=torch.float32)
    if path == "by_pair_gemv":
        runs = [by_pair_moe_tiles(SHAPE, tokens, gemv=True)]
    else:
        runs = [scaled, registers]
    outs = [fused_moe(x, **packed, **routed, tiles=tiles) for tiles in runs]
    for out in outs:
        error = (out.float() - expected).norm() / expected.norm()
        assert error < 1e-2, f"relative error {error:.2e}"
    if len(outs) == 2:
        torch.testing.assert_close(outs[0], outs[1], atol=0.1, rtol=0.05)
