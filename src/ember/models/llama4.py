"""Llama 4's text model: `Llama4ForCausalLM`, and the text model of a
`Llama4ForConditionalGeneration` checkpoint (its tensors under ``language_model.``; the vision
tower and its projector are not read, and a request with images is refused by the server).

Everything but the MLP and the checkpoint's layout is `ember.models.llama`'s: each layer's
chunked local attention, NoPE, QK L2 norm and temperature tuning come from
``ModelConfig.layer_attention``. MoE layers (``moe_layers``) run `Llama4MoeBlock`, the others a
dense MLP of ``intermediate_size_mlp``.

RoPE: Llama 4 rotates adjacent pairs ``(x[2i], x[2i + 1])`` by frequency i; ember's kernels
rotate halves ``(x[i], x[i + D/2])``. Each head's rows of q_proj and k_proj are reordered once
loaded (pair i to rows i and i + D/2), so rotating halves of the reordered q and k gives the
rotated pairs, reordered. Nothing after RoPE sees the order: the QK L2 norm is per head, and
q.k is the same when q and k are reordered alike; v and o keep theirs.

Experts: the checkpoint stacks them as transformers holds them, ``feed_forward.experts.
gate_up_proj`` [E, H, 2I] (gate columns, then up columns) and ``down_proj`` [E, I, H]: the
ops' ``w13`` [E, 2I, H] and ``w2`` [E, H, I] transposed. Their bytes land in the parameters in
the checkpoint's order and are transposed in place, one expert at a time, once loaded.

Over several tensor-parallel ranks each reads its ``1 / size`` of every expert's gate columns
and the matching up columns of ``gate_up_proj`` (two runs of each row), and the matching rows
of ``down_proj``; the shared expert and the dense MLPs are cut as any dense MLP is, and the
shared expert's partial output joins the experts' in the block's one all-reduce. The router
(and so the sigmoid that scales each token's input) is whole on every rank; attention (QK L2
norm, NoPE layers, chunks) splits by heads as the dense model's does.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Mapping
from types import MappingProxyType

import torch
from torch import nn

from ember.config import ModelConfig
from ember.layers.ops import Ops
from ember.layers.residual import ResidualStream, add_sub_block_result, sub_block_input
from ember.models.checkpoint_layout import CheckpointLayout, Shapes
from ember.models.llama import (
    MLP,
    LlamaForCausalLM,
    attention_tensors,
    dense_mlp_tensors,
    is_ignored_tensor,
    shared_tensors,
)
from ember.models.moe import Routing, SparseMoeBlock, route
from ember.parallel.group import ParallelGroup
from ember.parallel.sharding import Split, TensorSlice
from ember.weights.gguf_names import undo_rope_permutation

# model.layers.{i}.feed_forward.experts.{gate_up_proj | down_proj}, after the checkpoint prefix
_STACKED_EXPERTS = re.compile(
    r"model\.layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)"
)
_EXPERT_PARAMS = MappingProxyType({"gate_up_proj": "w13", "down_proj": "w2"})
# Where the stacked experts hold their intermediate rows: gate_up_proj [E, H, 2I] (gate
# columns, then up columns), down_proj [E, I, H].
_EXPERT_SPLITS = MappingProxyType({"gate_up_proj": Split(2, parts=2), "down_proj": Split(1)})


class Llama4MoeBlock(SparseMoeBlock):
    """Llama 4's MoE MLP: the router's top-1 expert takes the token scaled by its score (the
    sigmoid of its logit), and a shared expert (``shared_expert``, a dense MLP) takes it as
    it is; their outputs are added. Over several ranks (``parallel``) both are this rank's
    rows, and their sum is summed over the ranks once."""

    def __init__(self, cfg: ModelConfig, ops: Ops, parallel: ParallelGroup | None = None) -> None:
        super().__init__(cfg, ops, Routing.LLAMA4, parallel=parallel)
        if self.top_k != 1:
            raise ValueError(
                "Llama 4's routing scales each token's input to its expert: one expert per "
                f"token, not {self.top_k}"
            )
        self.shared_expert = MLP(cfg, ops, cfg.shared_expert_intermediate_size, self.parallel)

    def forward(self, stream: ResidualStream, norm_weight: torch.Tensor) -> ResidualStream:
        ops = self.ops
        x, row_norm, stream = sub_block_input(ops, stream, norm_weight)
        if row_norm is not None:
            raise ValueError("a mixture-of-experts block reads the plain residual stream only")
        logits = ops.linear(x, self.gate.weight)
        scores, ids = route(self.routing, logits, self.top_k, self.norm_topk_prob)
        # The input scaled in the model's dtype, as transformers scales it; the output taken whole.
        scaled = x * scores.to(x.dtype)
        routed = ops.moe_experts(scaled, self.w13, self.w2, torch.ones_like(scores), ids)
        shared = self.shared_expert
        act = ops.gate_up_silu(x, shared.gate_up_proj.operand)
        out = ops.linear(act, shared.down_proj.operand) + routed
        return add_sub_block_result(ops, stream, self.parallel.all_reduce(out))


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama 4's text model; its checkpoint tensors are under ``checkpoint_prefix``."""

    checkpoint_prefix = ""

    def mlp_for_layer(self, cfg: ModelConfig, ops: Ops, layer: int) -> nn.Module:
        if cfg.is_moe_layer(layer):
            return Llama4MoeBlock(cfg, ops, self.parallel)
        return MLP(cfg, ops, parallel=self.parallel)

    @staticmethod
    def can_defer_norms(cfg: ModelConfig) -> bool:
        """Never: the expert block reads the plain stream only (`ember.models.moe` says why)."""
        return False

    # -- weights ---------------------------------------------------------------------------------

    @classmethod
    def checkpoint_layout(
        cls, cfg: ModelConfig, stored_names: Collection[str] = ()
    ) -> CheckpointLayout:
        """The checkpoint tensors a model of ``cfg`` reads (the experts stacked, as every Llama 4
        checkpoint transformers reads holds them)."""
        if cfg.fp8 is not None:
            raise ValueError(
                f"{cfg.architecture}: FP8 weights (an FP8 checkpoint, or --quantization fp8) "
                "are not supported for Llama 4 yet; serve it in bf16"
            )
        return CheckpointLayout(
            cfg.architecture,
            cfg.num_layers,
            shared_tensors(cfg),
            attention_tensors(cfg),
            functools.partial(_is_ignored, cfg, cls.checkpoint_prefix),
            layer_specific=functools.partial(
                _feed_forward_tensors, cfg, _moe_tensors(cfg), _dense_tensors(cfg)
            ),
            prefix=cls.checkpoint_prefix,
        )

    @torch.no_grad()
    def arrange_loaded_weights(self) -> None:
        """Each head's q and k rows from adjacent RoPE pairs to halves, and the experts from
        the checkpoint's [E, in, out] to the ops' [E, out, in] (the module docstring)."""
        cfg = self.cfg
        for layer in self.layers:
            rows = layer.self_attn.qkv_proj.weight
            q, k = rows[: cfg.q_size], rows[cfg.q_size : cfg.q_size + cfg.kv_size]
            # The rows llama.cpp permutes into adjacent pairs are stored so here: undo it alike.
            q.copy_(undo_rope_permutation(q, cfg.num_heads))
            k.copy_(undo_rope_permutation(k, cfg.num_kv_heads))
            if isinstance(layer.mlp, Llama4MoeBlock):
                _transpose_each_expert(layer.mlp.w13)
                _transpose_each_expert(layer.mlp.w2)

    def tensor_slice(self, hf_name: str, shape: tuple[int, ...]) -> TensorSlice | None:
        """The slice this rank reads: of the experts' (`_EXPERT_SPLITS`), or, under the names
        of a Llama checkpoint, of the attention, the shared expert and the dense MLPs."""
        parallel, prefix = self.parallel, self.checkpoint_prefix
        if parallel.size == 1 or not hf_name.startswith(prefix):
            return None
        name = hf_name[len(prefix) :]
        if match := _STACKED_EXPERTS.fullmatch(name):
            return _EXPERT_SPLITS[match[2]].slice_for(shape, parallel.rank, parallel.size)
        name = name.replace(".feed_forward.shared_expert.", ".mlp.")
        return super().tensor_slice(name.replace(".feed_forward.", ".mlp."), shape)

    def _param_name(self, hf_name: str) -> tuple[str | None, int | None]:
        prefix = self.checkpoint_prefix
        if _is_ignored(self.cfg, prefix, hf_name):
            return None, None
        name = hf_name[len(prefix) :]
        if match := _STACKED_EXPERTS.fullmatch(name):
            return f"layers.{match[1]}.mlp.{_EXPERT_PARAMS[match[2]]}", 0
        name = name.replace(".feed_forward.router.", ".mlp.gate.")
        return super()._param_name(name.replace(".feed_forward.", ".mlp."))

    def _shard_view(self, data: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        if name.endswith((".w13", ".w2")):  # the whole stack, as the checkpoint orders it
            experts, rows, cols = data.shape
            return data.view(experts, cols, rows)
        if ".shared_expert." in name:  # shard 0: the gate rows, 1: the up rows
            inter = self.cfg.shared_expert_intermediate_size
            return data.narrow(0, shard * inter, inter)
        return super()._shard_view(data, name, shard)

    def _shard_count(self, name: str) -> int:
        if name.endswith((".w13", ".w2")):
            return 1
        return super()._shard_count(name)


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The text model of a multimodal Llama 4 checkpoint."""

    checkpoint_prefix = "language_model."


def _transpose_each_expert(stack: torch.Tensor) -> None:
    """``stack`` [E, A, B] holding each expert's [B, A] bytes: each expert transposed in
    place, through a copy of one expert (the two views overlap)."""
    _, rows, cols = stack.shape
    for expert in stack:
        expert.copy_(expert.view(cols, rows).t().contiguous())


def _is_ignored(cfg: ModelConfig, prefix: str, hf_name: str) -> bool:
    """A checkpoint tensor the model does not read: one outside its text model (the vision
    tower and its projector), or one a Llama checkpoint may hold unread."""
    return not hf_name.startswith(prefix) or is_ignored_tensor(cfg, hf_name[len(prefix) :])


def _moe_tensors(cfg: ModelConfig) -> dict[str, Shapes]:
    experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shared = {
        f"feed_forward.shared_expert.{name.removeprefix('mlp.')}": shape
        for name, shape in dense_mlp_tensors(hidden, cfg.shared_expert_intermediate_size).items()
    }
    return {
        "feed_forward.router.weight": (experts, hidden),
        "feed_forward.experts.gate_up_proj": (experts, hidden, 2 * inter),
        "feed_forward.experts.down_proj": (experts, inter, hidden),
        **shared,
    }


def _dense_tensors(cfg: ModelConfig) -> dict[str, Shapes]:
    return {
        f"feed_forward.{name.removeprefix('mlp.')}": shape
        for name, shape in dense_mlp_tensors(cfg.hidden_size, cfg.intermediate_size).items()
    }


def _feed_forward_tensors(
    cfg: ModelConfig, moe: Mapping[str, Shapes], dense: Mapping[str, Shapes], layer: int
) -> Mapping[str, Shapes]:
    """Layer ``layer``'s MLP tensors (names after ``model.layers.{i}.``)."""
    return moe if cfg.is_moe_layer(layer) else dense
