"""OpenAI's gpt-oss (``GptOssForCausalLM``): the Llama-family decoder with a bias on every
attention projection (o_proj's too), a learned sink logit per query head, sliding-window layers
alternating with full ones, YaRN RoPE (`ember.config.YarnRopeScaling`), and in every layer a
mixture of experts whose router has a bias, whose experts have biases and whose activation is
the clamped SwiGLU ``swiglu_oai`` (docs/CONTRACTS.md, "Mixture of experts").

The checkpoint holds each layer's experts stacked, in transformers' layout, which the ops'
differs from (every conversion runs once a layer's tensors have landed:
`ember.models.weight_placer`):
- ``mlp.experts.gate_up_proj`` [E, H, 2I]: the transpose of the stacked gate/up product, its
  columns interleaved (gate, up, gate, ...), and ``gate_up_proj_bias`` [E, 2I] alike: ember
  keeps ``w13`` [E, 2I, H] (gate rows, then up rows) and ``b13`` [E, 2I] in that order;
- ``mlp.experts.down_proj`` [E, I, H]: the transpose of ``w2`` [E, H, I]; ``down_proj_bias``
  [E, H] is ``b2`` as it is;
- in OpenAI's published checkpoints (``quant_method: mxfp4``) the two weights are MXFP4 instead:
  ``gate_up_proj_blocks`` [E, 2I, H/32, 16] with ``gate_up_proj_scales`` [E, 2I, H/32] (rows
  interleaved), ``down_proj_blocks`` [E, H, I/32, 16] with ``down_proj_scales``. With
  ``cfg.mxfp4_experts`` (what a plan sets for such a checkpoint) they stay packed
  (`ember.layers.mxfp4`): they land in ``w13_blocks`` / ``w13_scales`` and ``w2_blocks`` /
  ``w2_scales`` as they are, and gate_up's rows are put in the ops' order once every tensor has
  landed (`arrange_loaded_weights`, an expert at a time in place: no layer of scratch). Without
  it they are dequantized to the model's dtype as they land (`ember.weights.mxfp4`), every
  value exact in bf16;
- the router at ``mlp.router.weight`` [E, H] and ``mlp.router.bias`` [E].

Over several tensor-parallel ranks each reads its ``1 / size`` of every expert's intermediate
rows (`expert_split`): gate_up's (gate, up) pairs are interleaved, so a rank's pairs are one
contiguous run of columns (of rows, in MXFP4) and it de-interleaves them as one rank's w13;
down's rows (MXFP4: its scale groups along K, which must stay whole:
`ember.parallel.sharding.check_shardable`). The router, its bias and the sinks of the rank's
heads are read as the dense attention's are; ``down_proj_bias`` by rank 0 alone, which adds it
(`ember.models.moe`).

In bf16 two roundings differ from transformers' (float32 agrees to its tolerance): its RMSNorm
multiplies the weight into the float32 normalised rows and rounds once, where ember's norms
(the Llama family's) round the rows first; and its expert outputs are weighted and summed in
bf16, where `Ops.moe_experts` sums them in float32.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection
from types import MappingProxyType

import torch
from torch import nn

from ember.config import ModelConfig
from ember.layers.moe_routing import Routing
from ember.layers.ops import Ops
from ember.models.checkpoint_layout import CheckpointLayout
from ember.models.llama import attention_tensors, is_ignored_tensor, shared_tensors
from ember.models.llama_moe import MoeForCausalLM
from ember.models.moe import SparseMoeBlock
from ember.models.weight_placer import TensorConversion
from ember.parallel.sharding import Split
from ember.weights.mxfp4 import BLOCK_COLUMNS, dequantize_mxfp4

# model.layers.{i}.mlp.experts.{tensor}
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\w+)")
# model.layers.{i}.mlp.router.{weight | bias}
_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)")
_MXFP4_BLOCK_BYTES = BLOCK_COLUMNS // 2  # two FP4 codes a byte


class GptOssForCausalLM(MoeForCausalLM):
    routing = Routing.GPT_OSS
    block_name = "mlp"
    expert_projections = MappingProxyType({})  # stacked only: `tensor_conversion` reads them
    converts_tensors = True

    def mlp_for_layer(self, cfg: ModelConfig, ops: Ops, layer: int) -> nn.Module:
        return SparseMoeBlock(
            cfg, ops, self.routing, activation="swiglu_oai", biases=True, parallel=self.parallel
        )

    # -- weights ---------------------------------------------------------------------------------

    @classmethod
    def checkpoint_layout(
        cls, cfg: ModelConfig, stored_names: Collection[str] = ()
    ) -> CheckpointLayout:
        """The tensors a model of ``cfg`` reads: its experts in MXFP4 if ``stored_names`` (the
        checkpoint's) hold MXFP4 blocks, else in the model's dtype."""
        if cfg.fp8 is not None:
            raise ValueError(
                f"{cfg.architecture}: FP8 weights (an FP8 checkpoint, or --quantization fp8) "
                "are not supported for gpt-oss yet; serve it in bf16"
            )
        mxfp4 = any(name.endswith(".gate_up_proj_blocks") for name in stored_names)
        per_layer = {**attention_tensors(cfg), **expert_tensors(cfg, mxfp4)}
        return CheckpointLayout(
            cfg.architecture,
            cfg.num_layers,
            shared_tensors(cfg),
            per_layer,
            functools.partial(is_ignored_tensor, cfg),
        )

    def tensor_conversion(self, hf_name: str) -> TensorConversion | None:
        match = _EXPERTS.fullmatch(hf_name)
        if match is None or match[2] not in _CONVERSIONS or int(match[1]) >= self.cfg.num_layers:
            return None  # down_proj_bias is b2 as it is
        if self.cfg.mxfp4_experts and match[2] in _PACKED_PARAMS:
            return None  # lands packed, as it is
        param, names, convert = _CONVERSIONS[match[2]]
        shapes = expert_tensors(self.cfg, mxfp4=len(names) == 2)
        prefix = f"model.layers.{match[1]}.mlp.experts."
        inputs = tuple((prefix + name, shapes[f"mlp.experts.{name}"]) for name in names)
        return TensorConversion(f"layers.{match[1]}.mlp.{param}", inputs, convert)

    def expert_split(self, hf_name: str, shape: tuple[int, ...]) -> Split | None:
        match = _EXPERTS.fullmatch(hf_name)
        return _EXPERT_SPLITS.get(match[2]) if match else None

    def _param_name(self, hf_name: str) -> tuple[str | None, int | None]:
        if match := _ROUTER.fullmatch(hf_name):
            return f"layers.{match[1]}.mlp.gate.{match[2]}", None
        if match := _EXPERTS.fullmatch(hf_name):
            if match[2] == "down_proj_bias" and self.parallel.rank != 0:
                return None, None  # rank 0 adds the experts' output biases
            param = "b2" if match[2] == "down_proj_bias" else _PACKED_PARAMS.get(match[2])
            if param is not None:
                return f"layers.{match[1]}.mlp.{param}", None
        return super()._param_name(hf_name)

    @torch.no_grad()
    def arrange_loaded_weights(self) -> None:
        """Packed MXFP4 gate_up rows from the checkpoint's interleaved order (gate, up, ...)
        to the ops' (gate rows, then up rows), an expert at a time."""
        super().arrange_loaded_weights()
        if not self.cfg.mxfp4_experts:
            return
        for layer in self.layers:
            for stack in (layer.mlp.w13_blocks, layer.mlp.w13_scales):
                for expert in stack:
                    expert.copy_(torch.cat((expert[0::2], expert[1::2])))


def expert_tensors(cfg: ModelConfig, mxfp4: bool) -> dict[str, tuple[int, ...]]:
    """A layer's router and experts as gpt-oss checkpoints hold them (names after
    ``model.layers.{i}.``): the weights in the model's dtype, or with ``mxfp4`` as MXFP4
    blocks and scales."""
    experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    tensors: dict[str, tuple[int, ...]] = {
        "mlp.router.weight": (experts, hidden),
        "mlp.router.bias": (experts,),
        "mlp.experts.gate_up_proj_bias": (experts, 2 * inter),
        "mlp.experts.down_proj_bias": (experts, hidden),
    }
    if not mxfp4:
        tensors["mlp.experts.gate_up_proj"] = (experts, hidden, 2 * inter)
        tensors["mlp.experts.down_proj"] = (experts, inter, hidden)
        return tensors
    for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        if cols % BLOCK_COLUMNS:
            raise ValueError(
                f"{cfg.architecture}: MXFP4 {name} needs a multiple of {BLOCK_COLUMNS} columns, "
                f"not {cols}"
            )
        groups = cols // BLOCK_COLUMNS
        tensors[f"mlp.experts.{name}_blocks"] = (experts, rows, groups, _MXFP4_BLOCK_BYTES)
        tensors[f"mlp.experts.{name}_scales"] = (experts, rows, groups)
    return tensors


# Conversions into the ops' layout, an expert at a time (a whole layer's temporaries would be
# gigabytes on the large models).


def _w13_from_interleaved_columns(w13: torch.Tensor, gate_up: torch.Tensor) -> None:
    inter = w13.shape[1] // 2
    for expert in range(w13.shape[0]):
        w13[expert, :inter].copy_(gate_up[expert, :, 0::2].T)
        w13[expert, inter:].copy_(gate_up[expert, :, 1::2].T)


def _b13_from_interleaved(b13: torch.Tensor, bias: torch.Tensor) -> None:
    inter = b13.shape[1] // 2
    b13[:, :inter].copy_(bias[:, 0::2])
    b13[:, inter:].copy_(bias[:, 1::2])


def _w2_from_transposed(w2: torch.Tensor, down: torch.Tensor) -> None:
    for expert in range(w2.shape[0]):
        w2[expert].copy_(down[expert].T)


def _w13_from_mxfp4(w13: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    inter = w13.shape[1] // 2
    for expert in range(w13.shape[0]):
        rows = dequantize_mxfp4(blocks[expert], scales[expert], w13.dtype)  # interleaved rows
        w13[expert, :inter].copy_(rows[0::2])
        w13[expert, inter:].copy_(rows[1::2])


def _w2_from_mxfp4(w2: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    for expert in range(w2.shape[0]):
        w2[expert].copy_(dequantize_mxfp4(blocks[expert], scales[expert], w2.dtype))


_GATE_UP_MXFP4 = ("w13", ("gate_up_proj_blocks", "gate_up_proj_scales"), _w13_from_mxfp4)
_DOWN_MXFP4 = ("w2", ("down_proj_blocks", "down_proj_scales"), _w2_from_mxfp4)
# Packed MXFP4 checkpoint tensors -> the parameters they land in as they are.
_PACKED_PARAMS = MappingProxyType(
    {
        "gate_up_proj_blocks": "w13_blocks",
        "gate_up_proj_scales": "w13_scales",
        "down_proj_blocks": "w2_blocks",
        "down_proj_scales": "w2_scales",
    }
)
# Where each expert tensor holds the intermediate rows the ranks split (``down_proj_bias``
# [E, H] has none): gate_up's (gate, up) pairs interleaved along 2I, so a rank's are one run.
_EXPERT_SPLITS = MappingProxyType(
    {
        "gate_up_proj": Split(2),  # [E, H, 2I]
        "gate_up_proj_bias": Split(1),  # [E, 2I]
        "down_proj": Split(1),  # [E, I, H]
        "gate_up_proj_blocks": Split(1),  # [E, 2I, H / 32, 16]
        "gate_up_proj_scales": Split(1),  # [E, 2I, H / 32]
        "down_proj_blocks": Split(2),  # [E, H, I / 32, 16]
        "down_proj_scales": Split(2),  # [E, H, I / 32]
    }
)
# Checkpoint tensor -> (the parameter it fills, the tensors that fill it, how).
_CONVERSIONS = MappingProxyType(
    {
        "gate_up_proj": ("w13", ("gate_up_proj",), _w13_from_interleaved_columns),
        "gate_up_proj_bias": ("b13", ("gate_up_proj_bias",), _b13_from_interleaved),
        "down_proj": ("w2", ("down_proj",), _w2_from_transposed),
        "gate_up_proj_blocks": _GATE_UP_MXFP4,
        "gate_up_proj_scales": _GATE_UP_MXFP4,
        "down_proj_blocks": _DOWN_MXFP4,
        "down_proj_scales": _DOWN_MXFP4,
    }
)
