"""A mixture-of-experts MLP: a router picks each token's experts and their weights, and
`Ops.moe_experts` runs them.

The routing is one variant per model family (`ember.layers.moe_routing.Routing`, run by
`Ops.moe_route`); the experts'
weights are stacked per layer as the ops read them (docs/CONTRACTS.md, "Mixture of experts"):
``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I], in the model's dtype, in
FP8 with a scale per expert and row, or packed in MXFP4 (`ember.layers.mxfp4`).

Over several tensor-parallel ranks (`ember.parallel.sharding`) every rank holds every expert's
``1 / size`` of the intermediate rows (``w13``'s gate rows and the matching up rows, ``w2``'s
matching input columns) and the whole router: each runs the same routing and the same fused
experts on its rows, and one all-reduce after the block sums the partial outputs. The
experts' output biases (``b2``) are added once: rank 0 holds them, the others none.

The block reads the residual stream in its plain form only. The deferred form (norm weights
folded into the projections, each row's 1/rms applied by the projection's reader) would need
x/rms materialised for the router and the experts (`moe_experts` takes no row statistics:
1/rms must reach the gate and up products before the activation), which costs what the norm
kernel it replaces costs, and folding the norm into the router would round its logits unlike
the checkpoint's, which can flip a near tie between experts. So MoE models never defer
(`ember.models.llama_moe`).
"""

from __future__ import annotations

import torch
from torch import nn

from ember.config import ModelConfig
from ember.layers.fp8 import FP8_DTYPE, Fp8Weight
from ember.layers.moe_routing import Routing
from ember.layers.mxfp4 import Mxfp4Weight, mxfp4_parameters
from ember.layers.ops import Ops
from ember.layers.residual import ResidualStream, add_sub_block_result, sub_block_input
from ember.models.llama import Projection
from ember.parallel.group import ParallelGroup

# Stacked experts as `Ops.moe_experts` takes them.
ExpertWeight = torch.Tensor | Fp8Weight | Mxfp4Weight


class SparseMoeBlock(nn.Module):
    """The MLP of a decoder layer as ``num_experts`` gated experts, ``num_experts_per_tok`` per
    token: ``gate`` (the router, [E, H]), ``w13`` and ``w2`` (the stacked experts).
    ``activation``: the experts' (`Ops.moe_experts`); ``biases``: the router and the experts
    have biases (gpt-oss: ``gate.bias`` [E], ``b13`` [E, 2I] in w13's row order, ``b2``
    [E, H]). With FP8 weights (``cfg.fp8``), ``w13`` and ``w2`` are float8 e4m3 and
    ``w13_scale`` [E, 2I] and ``w2_scale`` [E, H] their rows' float32 scales; with MXFP4 experts
    (``cfg.mxfp4_experts``) they are ``w13_blocks`` / ``w13_scales`` and ``w2_blocks`` /
    ``w2_scales`` (`ember.layers.mxfp4.Mxfp4Weight`). The router keeps the model's dtype.
    ``cfg``: this rank's share (`ember.parallel.sharding.rank_config`); ``parallel``: its ranks,
    which sum the experts' outputs (``b2`` on rank 0 only)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        routing: Routing,
        activation: str = "silu",
        biases: bool = False,
        parallel: ParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.ops, self.routing, self.activation = ops, routing, activation
        self.parallel = parallel = parallel or ParallelGroup()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Projection(hidden, experts, bias=biases)
        self.fp8 = cfg.fp8 is not None
        self.mxfp4 = cfg.mxfp4_experts
        if self.fp8 and self.mxfp4:
            raise ValueError("MXFP4 experts beside FP8 weights are not supported")
        dtype = FP8_DTYPE if self.fp8 else None
        if self.mxfp4:
            self.w13_blocks, self.w13_scales = mxfp4_parameters(experts, 2 * inter, hidden)
            self.w2_blocks, self.w2_scales = mxfp4_parameters(experts, hidden, inter)
        else:
            self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=dtype))
            self.w2 = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype))
        if self.fp8:
            self.w13_scale = nn.Parameter(torch.empty(experts, 2 * inter, dtype=torch.float32))
            self.w2_scale = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32))
        self.register_parameter(
            "b13", nn.Parameter(torch.empty(experts, 2 * inter)) if biases else None
        )
        # Added inside each rank's partial sum, so held by one rank: added once over the ranks.
        holds_b2 = biases and parallel.rank == 0
        self.register_parameter(
            "b2", nn.Parameter(torch.empty(experts, hidden)) if holds_b2 else None
        )

    def experts(self) -> tuple[ExpertWeight, ExpertWeight]:
        """``(w13, w2)`` as `Ops.moe_experts` takes them: `Fp8Weight`s of FP8 experts,
        `Mxfp4Weight`s of MXFP4 ones."""
        if self.mxfp4:
            return (
                Mxfp4Weight(self.w13_blocks, self.w13_scales),
                Mxfp4Weight(self.w2_blocks, self.w2_scales),
            )
        if self.fp8:
            return Fp8Weight(self.w13, self.w13_scale), Fp8Weight(self.w2, self.w2_scale)
        return self.w13, self.w2

    def fp8_weights(self) -> list[Fp8Weight]:
        """The FP8 experts with their scales (`ember.layers.fp8.held_fp8_weights`), if FP8."""
        return list(self.experts()) if self.fp8 else []

    def mxfp4_weights(self) -> list[Mxfp4Weight]:
        """The MXFP4 experts (`ember.layers.mxfp4.held_mxfp4_weights`), if MXFP4."""
        return list(self.experts()) if self.mxfp4 else []

    def forward(self, stream: ResidualStream, norm_weight: torch.Tensor) -> ResidualStream:
        x, row_norm, stream = sub_block_input(self.ops, stream, norm_weight)
        if row_norm is not None:
            raise ValueError("a mixture-of-experts block reads the plain residual stream only")
        logits = self.ops.linear(x, self.gate.weight, self.gate.bias)
        weights, ids = self.ops.moe_route(self.routing, logits, self.top_k, self.norm_topk_prob)
        out = self.ops.moe_experts(
            x, *self.experts(), weights, ids, activation=self.activation, b13=self.b13, b2=self.b2
        )
        return add_sub_block_result(self.ops, stream, self.parallel.all_reduce(out))
