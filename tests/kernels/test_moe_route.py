"""The one-launch MoE routing kernel (`ember.kernels.moe_route`) against the torch reference
(`ember.layers.moe_routing.route_reference`, itself checked against transformers' routers):
every family, float32 and bfloat16 logits, expert counts that are and are not powers of two."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.moe_route import moe_route
from ember.layers.moe_routing import Routing, route_reference

FAMILIES = {
    "mixtral": (Routing.MIXTRAL, True, 2),
    "qwen3-moe": (Routing.QWEN3_MOE, False, 8),
    "qwen3-moe-norm-topk": (Routing.QWEN3_MOE, True, 8),
    "gpt-oss": (Routing.GPT_OSS, True, 4),
    "llama4": (Routing.LLAMA4, False, 1),
}


def distinct_logits(gen, tokens: int, experts: int, dtype) -> torch.Tensor:
    """Each row a permutation of ``experts`` values exact in bf16 (no ties: a tie's order is
    torch's to choose), spread over a few units like a router's."""
    rows = [torch.randperm(experts, generator=gen) for _ in range(tokens)]
    return ((torch.stack(rows).float() - experts / 2) * (6 / experts)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("experts", [8, 60, 128])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_kernel_picks_and_weighs_as_the_reference(gen, device, family, experts, dtype):
    routing, norm_topk_prob, top_k = FAMILIES[family]
    logits = distinct_logits(gen, 37, experts, dtype)
    want_weights, want_ids = route_reference(routing, logits, top_k, norm_topk_prob)
    weights, ids = moe_route(routing, logits.to(device), top_k, norm_topk_prob)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.cpu(), want_ids)
    if routing is Routing.MIXTRAL or dtype == torch.float32:
        # float32 weights: within a few ulps of the reference's exponentials and sums.
        torch.testing.assert_close(weights.cpu(), want_weights, rtol=2.0**-20, atol=0)
    else:  # rounded to bf16: the same values, or one rounding step apart
        assert torch.equal(weights.cpu(), weights.cpu().to(dtype).float())
        torch.testing.assert_close(weights.cpu(), want_weights, rtol=2.0**-7, atol=0)


def test_a_tie_goes_to_the_lowest_expert(device):
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0, -1.0]], device=device)
    _, ids = moe_route(Routing.QWEN3_MOE, logits, 3, True)
    assert ids.cpu().tolist() == [[1, 2, 4]]


def test_strided_logits_and_no_tokens(gen, device):
    logits = distinct_logits(gen, 9, 16, torch.float32)
    wide = torch.zeros(9, 20)
    wide[:, :16] = logits
    weights, ids = moe_route(Routing.GPT_OSS, wide[:, :16].to(device), 4, True)
    want_weights, want_ids = route_reference(Routing.GPT_OSS, logits, 4, True)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=2.0**-20, atol=0)
    weights, ids = moe_route(Routing.GPT_OSS, logits[:0].to(device), 4, True)
    assert weights.shape == ids.shape == (0, 4)


def test_a_top_k_past_the_experts_is_refused(device):
    with pytest.raises(ValueError, match="top_k"):
        moe_route(Routing.MIXTRAL, torch.zeros(2, 4, device=device), 5, True)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's NaN math
def test_rows_of_nan_or_too_few_finite_logits_still_name_real_experts(device):
    """What a broken checkpoint or an uninitialised warm-up buffer may hold: the ids must stay
    in range, or the expert kernels would read past the weights."""
    logits = torch.full((3, 6), float("nan"))
    logits[1, 2] = 1.0
    logits[2] = -float("inf")
    _, ids = moe_route(Routing.QWEN3_MOE, logits.to(device), 4, True)
    assert ((ids >= 0) & (ids < 6)).all()
    assert ids.cpu()[1, 0] == 2
