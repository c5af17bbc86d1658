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

Experts: a float checkpoint stacks them as transformers holds them, ``feed_forward.experts.
gate_up_proj`` [E, H, 2I] (gate columns, then up columns) and ``down_proj`` [E, I, H]: the
ops' ``w13`` [E, 2I, H] and ``w2`` [E, H, I] transposed. Their bytes land in the parameters in
the checkpoint's order and are transposed in place, one expert at a time, once loaded.

FP8 (``cfg.fp8``): the attention projections, the dense MLPs and the shared expert are FP8
projections as in every Llama-family model, the experts FP8 stacks with a scale per expert and
row (`ember.models.moe.SparseMoeBlock`), the router in the model's dtype.
- An FP8 checkpoint holds each expert's projections one by one, as llm-compressor writes Llama
  4 (``feed_forward.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, ``weight`` [out, in]
  beside its ``weight_scale``); they land as `MoeForCausalLM`'s do. FP8 experts stored stacked
  are refused (no tool writes them).
- Quantized at load (``--quantization fp8``), each stacked float tensor lands in scratch alone
  (`load_group`: the largest float copy a load holds, 2.7 GB of Scout's bf16 gate/up) and is
  quantized an expert at a time by rows of its transpose (`TensorConversion`).
The q/k rows are reordered once loaded with their row scales: a row's scale is its own, so
reordering after quantizing is exact.

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
from collections.abc import Collection, Hashable, Mapping
from types import MappingProxyType

import torch
from torch import nn

from ember.config import ModelConfig
from ember.layers.fp8 import Fp8Weight, quantize_rows_into
from ember.layers.moe_routing import Routing
from ember.layers.ops import Ops
from ember.layers.residual import ResidualStream, add_sub_block_result, sub_block_input
from ember.models.checkpoint_layout import CheckpointLayout, Shapes
from ember.models.llama import (
    MLP,
    attention_tensors,
    dense_mlp_tensors,
    fp8_scale_tensors,
    is_ignored_tensor,
    shared_tensors,
)
from ember.models.llama_moe import MoeForCausalLM
from ember.models.moe import SparseMoeBlock
from ember.models.weight_placer import TensorConversion
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
        scores, ids = ops.moe_route(self.routing, logits, self.top_k, self.norm_topk_prob)
        # The input scaled in the model's dtype, as transformers scales it; the output taken whole.
        scaled = x * scores.to(x.dtype)
        routed = ops.moe_experts(scaled, *self.experts(), torch.ones_like(scores), ids)
        shared = self.shared_expert
        act = ops.gate_up_silu(x, shared.gate_up_proj.operand)
        out = ops.linear(act, shared.down_proj.operand) + routed
        return add_sub_block_result(ops, stream, self.parallel.all_reduce(out))


class Llama4ForCausalLM(MoeForCausalLM):
    """Llama 4's text model; its checkpoint tensors are under ``checkpoint_prefix``."""

    routing = Routing.LLAMA4
    block_name = "feed_forward"
    # An FP8 checkpoint's experts, one tensor each (llm-compressor's names).
    expert_projections = MappingProxyType(
        {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
    )

    def mlp_for_layer(self, cfg: ModelConfig, ops: Ops, layer: int) -> nn.Module:
        if cfg.is_moe_layer(layer):
            return Llama4MoeBlock(cfg, ops, self.parallel)
        return MLP(cfg, ops, parallel=self.parallel)

    @classmethod
    def router_module(cls) -> str:
        return "feed_forward.router"

    @property
    def converts_tensors(self) -> bool:
        """Whether stacked float experts are quantized as they load (`tensor_conversion`)."""
        return _quantizes_at_load(self.cfg)

    # -- weights ---------------------------------------------------------------------------------

    @classmethod
    def checkpoint_layout(
        cls, cfg: ModelConfig, stored_names: Collection[str] = ()
    ) -> CheckpointLayout:
        """The checkpoint tensors a model of ``cfg`` reads: its experts stacked in float (as
        every Llama 4 checkpoint transformers reads holds them), one tensor per expert in FP8
        (as llm-compressor writes them; ``stored_names``, the checkpoint's, may not stack them)."""
        prefix = cls.checkpoint_prefix
        per_expert = _fp8_checkpoint(cfg)
        stacked = any(
            _STACKED_EXPERTS.fullmatch(name.removeprefix(prefix)) for name in stored_names
        )
        if per_expert and stacked:
            raise ValueError(
                f"{cfg.architecture}: FP8 experts stored stacked are not supported; ember loads "
                "FP8 experts stored one tensor per expert, as llm-compressor writes them"
            )
        per_layer = attention_tensors(cfg)
        moe = _moe_tensors(cfg, per_expert)
        dense = _dense_tensors(cfg)
        optional = {
            **fp8_scale_tensors(cfg, per_layer),
            **fp8_scale_tensors(cfg, moe),
            **fp8_scale_tensors(cfg, dense),
        }
        return CheckpointLayout(
            cfg.architecture,
            cfg.num_layers,
            shared_tensors(cfg),
            per_layer,
            functools.partial(_is_ignored, cfg, prefix),
            optional,
            layer_specific=functools.partial(_feed_forward_tensors, cfg, moe, dense),
            prefix=prefix,
        )

    @torch.no_grad()
    def arrange_loaded_weights(self) -> None:
        """Each head's q and k rows (and an FP8 projection's row scales) from adjacent RoPE
        pairs to halves, and float experts from the checkpoint's [E, in, out] to the ops'
        [E, out, in] (the module docstring)."""
        cfg = self.cfg
        for layer in self.layers:
            qkv = layer.self_attn.qkv_proj
            _rope_pairs_to_halves(qkv.weight, cfg)
            if qkv.fp8:
                _rope_pairs_to_halves(qkv.weight_scale, cfg)
            if _experts_land_transposed(cfg) and isinstance(layer.mlp, Llama4MoeBlock):
                _transpose_each_expert(layer.mlp.w13)
                _transpose_each_expert(layer.mlp.w2)

    def tensor_conversion(self, hf_name: str) -> TensorConversion | None:
        """Quantized at load: a stacked expert tensor, quantized from its transpose."""
        match = _STACKED_EXPERTS.fullmatch(hf_name.removeprefix(self.checkpoint_prefix))
        if match is None or not _quantizes_at_load(self.cfg):
            return None
        shape = _stacked_tensors(self.cfg)[f"feed_forward.experts.{match[2]}"]
        param = f"layers.{match[1]}.mlp.{_EXPERT_PARAMS[match[2]]}"
        return TensorConversion(param, ((hf_name, shape),), _quantize_transposed_experts)

    def load_group(self, hf_name: str) -> Hashable:
        """A layer's tensors land together, but each stacked expert tensor, which lands alone
        (a third of a Scout layer's float weights at most, when quantized at load), and the
        per-expert ones (`MoeForCausalLM.load_group`)."""
        name = hf_name.removeprefix(self.checkpoint_prefix)
        if match := _STACKED_EXPERTS.fullmatch(name):
            return int(match[1]), match[2]
        return super().load_group(name)

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
        return super()._param_name(name.replace(".feed_forward.router.", ".feed_forward.gate."))

    def _shard_view(self, data: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        if _experts_land_transposed(self.cfg) and name.endswith((".w13", ".w2")):
            experts, rows, cols = data.shape  # the whole stack, as the checkpoint orders it
            return data.view(experts, cols, rows)
        if ".shared_expert." in name:  # shard 0: the gate rows (or their scales), 1: the up rows
            inter = self.cfg.shared_expert_intermediate_size
            return data.narrow(0, shard * inter, inter)
        return super()._shard_view(data, name, shard)

    def _shard_count(self, name: str) -> int:
        if _experts_land_transposed(self.cfg) and name.endswith((".w13", ".w2")):
            return 1
        return super()._shard_count(name)


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The text model of a multimodal Llama 4 checkpoint."""

    checkpoint_prefix = "language_model."


def _fp8_checkpoint(cfg: ModelConfig) -> bool:
    """Whether the checkpoint holds FP8 weights (its experts one tensor each)."""
    return cfg.fp8 is not None and cfg.fp8.from_checkpoint


def _quantizes_at_load(cfg: ModelConfig) -> bool:
    """Whether float weights are quantized to FP8 as they load (``--quantization fp8``)."""
    return cfg.fp8 is not None and not cfg.fp8.from_checkpoint


def _experts_land_transposed(cfg: ModelConfig) -> bool:
    """Whether stacked experts land in their parameters as stored (float experts), to be
    transposed once loaded."""
    return cfg.fp8 is None


def _rope_pairs_to_halves(rows: torch.Tensor, cfg: ModelConfig) -> None:
    """The q and k rows of fused q/k/v ``rows`` (a weight, or its row scales) in place, each
    head's from adjacent pairs to halves."""
    q, k = rows[: cfg.q_size], rows[cfg.q_size : cfg.q_size + cfg.kv_size]
    # The rows llama.cpp permutes into adjacent pairs are stored so here: undo it alike.
    q.copy_(undo_rope_permutation(q, cfg.num_heads))
    k.copy_(undo_rope_permutation(k, cfg.num_kv_heads))


def _transpose_each_expert(stack: torch.Tensor) -> None:
    """``stack`` [E, A, B] holding each expert's [B, A] bytes: each expert transposed in
    place, through a copy of one expert (the two views overlap)."""
    _, rows, cols = stack.shape
    for expert in stack:
        expert.copy_(expert.view(cols, rows).t().contiguous())


def _quantize_transposed_experts(target: Fp8Weight, stacked: torch.Tensor) -> None:
    """``stacked`` [E, in, out] (the checkpoint's) quantized into FP8 ``target`` [E, out, in]
    and its row scales, an expert at a time by rows of its transpose."""
    for expert in range(stacked.shape[0]):
        quantize_rows_into(stacked[expert].T, target.weight[expert], target.scale[expert])


def _is_ignored(cfg: ModelConfig, prefix: str, hf_name: str) -> bool:
    """A checkpoint tensor the model does not read: one outside its text model (the vision
    tower and its projector), or one a Llama checkpoint may hold unread."""
    return not hf_name.startswith(prefix) or is_ignored_tensor(cfg, hf_name[len(prefix) :])


def _stacked_tensors(cfg: ModelConfig) -> dict[str, Shapes]:
    """A layer's experts as transformers stacks them (names after ``model.layers.{i}.``)."""
    experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return {
        "feed_forward.experts.gate_up_proj": (experts, hidden, 2 * inter),
        "feed_forward.experts.down_proj": (experts, inter, hidden),
    }


def _per_expert_tensors(cfg: ModelConfig) -> dict[str, Shapes]:
    """A layer's experts one tensor each, as llm-compressor writes them."""
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    tensors: dict[str, Shapes] = {}
    for expert in range(cfg.num_experts):
        stem = f"feed_forward.experts.{expert}"
        tensors[f"{stem}.gate_proj.weight"] = (inter, hidden)
        tensors[f"{stem}.up_proj.weight"] = (inter, hidden)
        tensors[f"{stem}.down_proj.weight"] = (hidden, inter)
    return tensors


def _moe_tensors(cfg: ModelConfig, per_expert: bool) -> dict[str, Shapes]:
    """An MoE layer's router, experts (``per_expert``: one tensor each, else stacked) and
    shared expert."""
    shared = {
        f"feed_forward.shared_expert.{name.removeprefix('mlp.')}": shape
        for name, shape in dense_mlp_tensors(
            cfg.hidden_size, cfg.shared_expert_intermediate_size
        ).items()
    }
    experts = _per_expert_tensors(cfg) if per_expert else _stacked_tensors(cfg)
    return {
        "feed_forward.router.weight": (cfg.num_experts, cfg.hidden_size),
        **experts,
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
