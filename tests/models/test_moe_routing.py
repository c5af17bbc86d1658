"""`ember.layers.moe_routing.route_reference`: each family's experts and weights for a token,
as transformers' router modules pick them, in float32 and bfloat16. (The Triton ops' one-launch
form against it: tests/kernels/test_moe_route.py.)"""

from __future__ import annotations

import pytest
import torch

from ember.layers.moe_routing import Routing
from ember.layers.moe_routing import route_reference as route

transformers = pytest.importorskip("transformers")

T, H, E, K = 40, 16, 8, 3


def hf_router(routing: Routing, norm_topk_prob: bool, dtype: torch.dtype):
    if routing is Routing.GPT_OSS:
        config = transformers.GptOssConfig(
            hidden_size=H, num_local_experts=E, num_experts_per_tok=K
        )
        module = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(config)
        # The bias shifts some experts enough to change which are picked.
        module.bias.data.copy_(torch.randn(E, generator=torch.Generator().manual_seed(3)))
    elif routing is Routing.MIXTRAL:
        config = transformers.MixtralConfig(
            hidden_size=H, num_local_experts=E, num_experts_per_tok=K
        )
        module = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config)
    else:
        config = transformers.Qwen3MoeConfig(
            hidden_size=H, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob
        )
        module = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    g = torch.Generator().manual_seed(0)
    module.weight.data.copy_(torch.randn(E, H, generator=g) * 0.3)
    return module.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("routing", "norm_topk_prob"),
    [
        (Routing.MIXTRAL, True),
        (Routing.QWEN3_MOE, False),
        (Routing.QWEN3_MOE, True),
        (Routing.GPT_OSS, True),
    ],
    ids=["mixtral", "qwen3-moe", "qwen3-moe-norm-topk", "gpt-oss"],
)
def test_route_picks_what_transformers_picks(routing, norm_topk_prob, dtype):
    hf = hf_router(routing, norm_topk_prob, dtype)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        logits, hf_weights, hf_ids = hf(x)
        if routing is Routing.GPT_OSS:  # the model's router: one linear with its bias
            assert torch.equal(logits, torch.nn.functional.linear(x, hf.weight, hf.bias))
    weights, ids = route(routing, logits, K, norm_topk_prob)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (T, K)
    assert torch.equal(ids.long(), hf_ids)
    assert torch.equal(weights, hf_weights.float())  # the same values, rounded alike
    sums = weights.sum(-1)
    if norm_topk_prob:
        torch.testing.assert_close(sums, torch.ones(T), atol=1e-2, rtol=0)
    else:  # the top k's share of the probability, not renormalised
        assert (sums < 0.9).any()


def test_qwen3_moe_weights_are_rounded_to_the_logits_dtype():
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(2)).bfloat16()
    weights, _ = route(Routing.QWEN3_MOE, logits, K, True)
    assert torch.equal(weights, weights.bfloat16().float())
    mixtral, _ = route(Routing.MIXTRAL, logits, K, True)
    assert not torch.equal(mixtral, mixtral.bfloat16().float())  # Mixtral's stay float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama4_route_is_the_sigmoid_of_the_top_logit_as_transformers_scores_it(dtype):
    """transformers' Llama4Router scores every expert, the unchosen 0: the chosen one's score
    is the weight, rounded to the logits' dtype."""
    config = transformers.Llama4TextConfig(
        hidden_size=H, num_local_experts=E, num_experts_per_tok=1
    )
    hf = transformers.models.llama4.modeling_llama4.Llama4Router(config)
    hf.weight.data.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(0)) * 0.3)
    hf = hf.to(dtype)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        scores, logits = hf(x)
    weights, ids = route(Routing.LLAMA4, logits, 1, False)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    hf_weights, hf_ids = scores.topk(1, dim=-1)
    assert torch.equal(ids.long(), hf_ids)
    assert torch.equal(weights, hf_weights.float())
    assert (scores > 0).sum(-1).eq(1).all()  # one expert a token, as ember runs it


def test_gpt_oss_weights_are_a_softmax_of_the_top_k_rounded_to_the_logits_dtype():
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(4)).bfloat16()
    weights, ids = route(Routing.GPT_OSS, logits, K, False)
    assert torch.equal(weights, weights.bfloat16().float())
    top = logits.gather(1, ids.long()).float()
    torch.testing.assert_close(weights, torch.softmax(top, -1), atol=4e-3, rtol=0)
