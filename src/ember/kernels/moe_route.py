"""A MoE router's logits to each token's experts and weights in one launch: the Triton ops'
``moe_route`` (`ember.layers.moe_routing` says what each family computes; `route_reference`
is the torch form, five to eight small launches a layer).

One program per token holds its row of logits (``E`` up to a few hundred) in registers, picks
the top k by k arg-maxes (the lowest expert on a tie), and computes the family's weights from
them: a softmax over all experts then the chosen share (renormalised or not), a softmax over
the chosen k, or the chosen logits' sigmoid. Ranking the logits rather than the softmax's
probabilities picks the same experts (the softmax is increasing); the probabilities are
computed in float32 as torch does, to within an ulp of its exponential, and rounded to the
logits' dtype where the family rounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.compile_ahead import compiling_ahead, launch
from ember.layers.moe_routing import Routing

# The weights each family computes, by their kernel constant.
_SOFTMAX_ALL, _SOFTMAX_TOP_K, _SIGMOID = 0, 1, 2
_WEIGHTS = {
    Routing.MIXTRAL: _SOFTMAX_ALL,
    Routing.QWEN3_MOE: _SOFTMAX_ALL,
    Routing.GPT_OSS: _SOFTMAX_TOP_K,
    Routing.LLAMA4: _SIGMOID,
}


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_lt,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    EXPERTS: tl.constexpr,
    WEIGHTS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_lt + experts, mask=valid, other=-float("inf"))
    logits = logits.to(tl.float32)
    slots = tl.arange(0, SLOTS)
    top = tl.full([SLOTS], -float("inf"), tl.float32)
    ids = tl.zeros([SLOTS], tl.int32)
    # NaN ranks last; a row without k finite logits repeats its lowest expert: every id stays
    # an expert the kernels after this one may index.
    left = tl.where(logits != logits, -float("inf"), logits)  # noqa: PLR0124 (NaN test)
    for slot in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        chosen = tl.min(tl.where((left == best) & valid, experts, EXPERTS), 0)
        chosen = tl.minimum(chosen, num_experts - 1)
        top = tl.where(slots == slot, best, top)
        ids = tl.where(slots == slot, chosen, ids)
        left = tl.where(experts == chosen, -float("inf"), left)
    in_top_k = slots < TOP_K
    if WEIGHTS == 0:  # softmax over all experts, the chosen ones' share
        largest = tl.max(logits, 0)
        total = tl.sum(tl.where(valid, tl.exp(logits - largest), 0.0), 0)
        weights = tl.exp(top - largest) / total
        if RENORMALIZE:
            weights = weights / tl.sum(tl.where(in_top_k, weights, 0.0), 0)
    elif WEIGHTS == 1:  # softmax over the chosen k
        shifted = tl.where(in_top_k, tl.exp(top - tl.max(top, 0)), 0.0)
        weights = shifted / tl.sum(shifted, 0)
    else:
        weights = tl.sigmoid(top)
    if ROUND:
        weights = weights.to(logits_ptr.dtype.element_ty).to(tl.float32)
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, weights, mask=in_top_k)
    tl.store(ids_ptr + out, ids, mask=in_top_k)


def moe_route(
    routing: Routing, logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ember.layers.moe_routing.route_reference`'s ``(topk_weights, topk_ids)`` (float32 and
    int32 ``[T, top_k]``, the experts in descending order) of ``logits [T, E]`` in one launch."""
    tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    if compiling_ahead():  # only compiled: the torch ops after it must still read real experts
        ids.zero_()
        weights.zero_()
    experts = triton.next_power_of_2(num_experts)
    launch(
        _route_kernel,
        (tokens,),
        logits,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        TOP_K=top_k,
        SLOTS=triton.next_power_of_2(top_k),
        EXPERTS=experts,
        WEIGHTS=_WEIGHTS[routing],
        # Mixtral renormalises always, Qwen3-MoE iff its config says so.
        RENORMALIZE=routing is Routing.MIXTRAL or (routing is Routing.QWEN3_MOE and norm_topk_prob),
        # Mixtral's weights stay float32; the others are rounded to the logits' dtype.
        ROUND=routing is not Routing.MIXTRAL,
        num_warps=4 if experts >= 256 else 1,
    )
    return weights, ids
