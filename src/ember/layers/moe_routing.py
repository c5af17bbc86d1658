"""How a MoE router's logits become each token's experts and weights, one variant per model
family (`Routing`), and the plain-torch form of it (`route_reference`: the reference ops'
``moe_route``; the Triton ops' is `ember.kernels.moe_route`)."""

from __future__ import annotations

import enum

import torch


class Routing(enum.Enum):
    """How a model family turns router logits into each token's experts and weights."""

    # Softmax over all experts (float32), the top k, renormalised to sum to 1; the weights stay
    # float32 (transformers' MixtralTopKRouter).
    MIXTRAL = "mixtral"
    # Softmax over all experts (float32), the top k, renormalised iff ``norm_topk_prob``; the
    # weights rounded to the logits' dtype, as transformers' Qwen3MoeTopKRouter returns them.
    QWEN3_MOE = "qwen3_moe"
    # The top k of the logits (the router's bias already in them), then a softmax over those k
    # alone, rounded to the logits' dtype (transformers' GptOssTopKRouter).
    GPT_OSS = "gpt_oss"
    # The sigmoid of each chosen logit (the top k of the logits, in their dtype), rounded to the
    # logits' dtype, as transformers' Llama4Router scores them. Llama 4 scales the expert's
    # input by it, not its output (`ember.models.llama4`).
    LLAMA4 = "llama4"


def route_reference(
    routing: Routing, logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights, topk_ids)`` of router ``logits`` [T, E] (the model's dtype): float32 and
    int32, both [T, top_k], the experts in descending order of probability."""
    if routing is Routing.GPT_OSS:
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1).to(logits.dtype).float()
        return weights, ids.to(torch.int32)
    if routing is Routing.LLAMA4:
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.sigmoid(top.float()).to(logits.dtype).float(), ids.to(torch.int32)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if routing is Routing.MIXTRAL:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    elif routing is Routing.QWEN3_MOE:
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype).float()
    else:
        raise ValueError(f"no routing for {routing}")
    return weights, ids.to(torch.int32)
