"""Llama-family decoders whose MLPs are mixtures of experts (`ember.models.moe`): Qwen3-MoE
(Qwen3's attention with its q/k norm; layers in ``mlp_only_layers`` or off
``decoder_sparse_step`` keep a dense MLP) and Mixtral (Mistral's attention, every layer
sparse). Everything but the MLP is `ember.models.llama`'s.

A checkpoint holds each layer's experts in one of two forms, and either loads into the stacked
``w13`` / ``w2`` parameters:
- one tensor per expert and projection, as transformers' ``save_pretrained`` writes them (and
  the published checkpoints hold them): ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` /
  ``down_proj`` for Qwen3-MoE, ``block_sparse_moe.experts.{e}.w1.weight`` / ``w3`` / ``w2``
  and ``block_sparse_moe.gate.weight`` for Mixtral;
- stacked, as transformers 5 holds them in memory (``save_pretrained(...,
  save_original_format=False)`` writes this): ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate
  rows, then up rows: the ops' layout already) and ``mlp.experts.down_proj`` [E, H, I], with the
  router at ``mlp.gate.weight``.

FP8 experts (``cfg.fp8``): an FP8 checkpoint holds each expert's projections one by one, as
llm-compressor writes them (float8 e4m3 beside a ``weight_scale`` per output channel or per
tensor), its routers in float; float experts, in either form, are quantized as they land, a few
experts at a time (`load_group`), so the float copy a load holds stays small.

Over several tensor-parallel ranks each reads its rows of every expert (`expert_split`): an
expert's gate and up rows (and their per-row FP8 scales) and its down projection's matching
columns, one tensor each; of the stacked form, each expert's gate and up rows of
``gate_up_proj`` (two runs of it) and columns of ``down_proj``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Hashable, Mapping
from types import MappingProxyType

import torch
from torch import nn

from ember.config import ModelConfig
from ember.layers.moe_routing import Routing
from ember.layers.ops import Ops
from ember.models.checkpoint_layout import CheckpointLayout, Shapes, layer_of
from ember.models.llama import (
    LlamaForCausalLM,
    attention_tensors,
    dense_mlp_tensors,
    fp8_scale_tensors,
    is_ignored_tensor,
    shared_tensors,
    weight_scale_shapes,
)
from ember.models.moe import SparseMoeBlock
from ember.models.weight_placer import SCALAR_SHAPES
from ember.parallel.sharding import Split, TensorSlice

# model.layers.{i}.{block}.experts.{e}.{projection}.weight (an FP8 checkpoint's: .weight_scale)
_PER_EXPERT = re.compile(
    r"(model\.layers\.\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.(weight|weight_scale)"
)
# model.layers.{i}.mlp.experts.{gate_up_proj | down_proj}
_STACKED = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_STACKED_PARAMS = MappingProxyType({"gate_up_proj": "w13", "down_proj": "w2"})
# Where the stacked tensors hold the experts' intermediate rows: gate_up_proj [E, 2I, H] (gate
# rows, then up rows), down_proj [E, H, I].
_STACKED_SPLITS = MappingProxyType({"gate_up_proj": Split(1, parts=2), "down_proj": Split(2)})
# Experts whose float weights land (and are quantized, with --quantization fp8) together: a
# layer of Qwen3-30B-A3B's 128 holds 1.2 GB of bf16, 16 of them 0.15 GB.
_EXPERTS_PER_LOAD_GROUP = 16


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder with `SparseMoeBlock` MLPs where ``cfg.is_moe_layer``. A family
    names its ``routing``, the block's name in its per-expert checkpoints (``block_name``), and
    its experts' projections there (``expert_projections``: checkpoint name -> the parameter,
    "w13" or "w2", and the half of w13 it fills: 0 gate, 1 up)."""

    routing: Routing
    block_name: str
    expert_projections: Mapping[str, tuple[str, int]]

    @classmethod
    def router_module(cls) -> str:
        """The router's module in a decoder layer (``model.layers.{i}.``), as an FP8
        checkpoint names it among the modules it leaves unquantized."""
        return f"{cls.block_name}.gate"

    def mlp_for_layer(self, cfg: ModelConfig, ops: Ops, layer: int) -> nn.Module:
        if cfg.is_moe_layer(layer):
            return SparseMoeBlock(cfg, ops, self.routing, parallel=self.parallel)
        return super().mlp_for_layer(cfg, ops, layer)

    @staticmethod
    def can_defer_norms(cfg: ModelConfig) -> bool:
        """Never: the expert block reads the plain stream only (`ember.models.moe` says why)."""
        return False

    # -- weights ---------------------------------------------------------------------------------

    @classmethod
    def checkpoint_layout(
        cls, cfg: ModelConfig, stored_names: Collection[str] = ()
    ) -> CheckpointLayout:
        """The checkpoint tensors a model of ``cfg`` reads: its experts stacked if
        ``stored_names`` (the checkpoint's) holds a stacked expert tensor, else one by one."""
        stacked = any(_STACKED.fullmatch(name) for name in stored_names)
        if stacked and cfg.fp8 is not None and cfg.fp8.from_checkpoint:
            raise ValueError(
                f"{cfg.architecture}: FP8 experts stored stacked are not supported; ember loads "
                "FP8 experts stored one tensor per expert, as llm-compressor writes them"
            )
        experts = _stacked_tensors(cfg) if stacked else cls._per_expert_tensors(cfg)
        dense = dense_mlp_tensors(cfg.hidden_size, cfg.intermediate_size)
        per_layer = attention_tensors(cfg)
        optional = {
            **fp8_scale_tensors(cfg, per_layer),
            **fp8_scale_tensors(cfg, dense),
            **_fp8_expert_scales(cfg, experts),
        }
        return CheckpointLayout(
            cfg.architecture,
            cfg.num_layers,
            shared_tensors(cfg),
            per_layer,
            functools.partial(is_ignored_tensor, cfg),
            optional,
            layer_specific=functools.partial(_mlp_tensors, cfg, experts, dense),
        )

    @classmethod
    def _per_expert_tensors(cls, cfg: ModelConfig) -> dict[str, Shapes]:
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        shapes = {"w13": (inter, hidden), "w2": (hidden, inter)}
        tensors = {f"{cls.block_name}.gate.weight": (cfg.num_experts, hidden)}
        for expert in range(cfg.num_experts):
            for projection, (param, _) in cls.expert_projections.items():
                name = f"{cls.block_name}.experts.{expert}.{projection}.weight"
                tensors[name] = shapes[param]
        return tensors

    def _param_name(self, hf_name: str) -> tuple[str | None, int | None]:
        if match := _PER_EXPERT.fullmatch(hf_name):
            layer, block, expert, projection = match[1], match[2], int(match[3]), match[4]
            place = self.expert_projections.get(projection)
            if block != self.block_name or place is None or expert >= self.cfg.num_experts:
                return hf_name, None  # no such parameter: the placer refuses it by name
            param, half = place
            shard = 2 * expert + half if param == "w13" else expert
            scale = "_scale" if match[5] == "weight_scale" else ""
            return f"{layer.removeprefix('model.')}.mlp.{param}{scale}", shard
        if match := _STACKED.fullmatch(hf_name):
            return f"{match[1].removeprefix('model.')}.mlp.{_STACKED_PARAMS[match[2]]}", None
        return super()._param_name(hf_name.replace(f".{self.block_name}.", ".mlp."))

    def _shard_view(self, data: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        # Shard 2e: expert e's gate rows (or their scales), 2e + 1: its up rows.
        if name.endswith((".w13", ".w13_scale")):
            inter = self.cfg.moe_intermediate_size
            return data[shard // 2].narrow(0, (shard % 2) * inter, inter)
        if name.endswith((".w2", ".w2_scale")):
            return data[shard]
        return super()._shard_view(data, name, shard)

    def _shard_count(self, name: str) -> int:
        if name.endswith((".w13", ".w13_scale")):
            return 2 * self.cfg.num_experts
        if name.endswith((".w2", ".w2_scale")):
            return self.cfg.num_experts
        return super()._shard_count(name)

    def tensor_slice(self, hf_name: str, shape: tuple[int, ...]) -> TensorSlice | None:
        parallel = self.parallel
        split = self.expert_split(hf_name, shape) if parallel.size > 1 else None
        if split is not None:
            return split.slice_for(shape, parallel.rank, parallel.size)
        return super().tensor_slice(hf_name, shape)

    def expert_split(self, hf_name: str, shape: tuple[int, ...]) -> Split | None:
        """Where checkpoint tensor ``hf_name`` (of ``shape``) holds the experts' intermediate
        rows, which the ranks split; None: not an expert tensor, or one every rank reads whole
        (a down projection's per-row scales, a per-tensor scale)."""
        if match := _STACKED.fullmatch(hf_name):
            return _STACKED_SPLITS[match[2]]
        match = _PER_EXPERT.fullmatch(hf_name)
        place = self.expert_projections.get(match[4]) if match else None
        if place is None or tuple(shape) in SCALAR_SHAPES:
            return None
        if place[0] == "w13":  # gate or up [I, H], or their per-row scales
            return Split(0)
        return Split(1) if match[5] == "weight" else None  # down [H, I]; its scales per H row

    def load_group(self, hf_name: str) -> Hashable:
        """A layer's tensors land together, but its experts' (one tensor each), which land
        `_EXPERTS_PER_LOAD_GROUP` experts at a time."""
        if match := _PER_EXPERT.fullmatch(hf_name):
            return layer_of(hf_name), int(match[3]) // _EXPERTS_PER_LOAD_GROUP
        return super().load_group(hf_name)


def _stacked_tensors(cfg: ModelConfig) -> dict[str, Shapes]:
    experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return {
        "mlp.gate.weight": (experts, hidden),
        "mlp.experts.gate_up_proj": (experts, 2 * inter, hidden),
        "mlp.experts.down_proj": (experts, hidden, inter),
    }


def _fp8_expert_scales(cfg: ModelConfig, experts: dict[str, Shapes]) -> dict[str, Shapes]:
    """An FP8 checkpoint's expert scales: each expert projection's ``weight_scale`` added to
    ``experts`` (one tensor per expert); returns the static activation scales they may have."""
    optional: dict[str, Shapes] = {}
    if cfg.fp8 is None or not cfg.fp8.from_checkpoint:
        return optional
    for name in [name for name in experts if ".experts." in name]:
        stem = name.removesuffix(".weight")
        experts[f"{stem}.weight_scale"] = weight_scale_shapes(cfg, experts[name][0])
        optional[f"{stem}.input_scale"] = SCALAR_SHAPES
    return optional


def _mlp_tensors(
    cfg: ModelConfig,
    experts: Mapping[str, Shapes],
    dense: Mapping[str, Shapes],
    layer: int,
) -> Mapping[str, Shapes]:
    """Layer ``layer``'s MLP tensors: its experts' or its dense MLP's."""
    return experts if cfg.is_moe_layer(layer) else dense


class Qwen3MoeForCausalLM(MoeForCausalLM):
    routing = Routing.QWEN3_MOE
    block_name = "mlp"
    expert_projections = MappingProxyType(
        {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
    )


class MixtralForCausalLM(MoeForCausalLM):
    routing = Routing.MIXTRAL
    block_name = "block_sparse_moe"
    expert_projections = MappingProxyType({"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)})
