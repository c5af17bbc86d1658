"""Which part of a model each tensor-parallel rank holds, and which slice of each checkpoint
tensor it reads (Megatron's split, as vLLM's):

- column-parallel: q, k, v (by heads) and gate, up (by intermediate rows) keep their output rows
  ``[rank * n, (rank + 1) * n)``, so the fused q/k/v and gate/up of a rank are the fused layouts
  of its heads and rows; their biases and per-row FP8 scales are cut alike;
- row-parallel: o and down keep the input columns that match, and one all-reduce sums their
  products; their output rows, biases and per-row scales are whole on every rank;
- KV heads: ``num_kv_heads / size`` per rank, or, with fewer KV heads than ranks, each rank
  holds the one KV head its query heads read (replicated over ``size / num_kv_heads`` ranks);
- vocabulary: each rank holds ``ceil(vocab / size)`` rows of the embeddings and the output
  head (the last rank's tail is padding, zero), looks up the ids it holds and the ranks sum;
- a mixture of experts (tensor-parallel experts, vLLM's default): every rank holds all the
  experts, each cut as a dense MLP is (``moe_intermediate_size / size`` of its gate and up rows,
  and the down projection's matching input columns); the router is whole on every rank, and
  the experts' partial outputs (with a shared expert's, cut alike) are summed by one
  all-reduce after the block. A model names where its checkpoint's expert tensors hold the
  intermediate dimension (`Split`).

A rank's model is built from the config of its share (`rank_config`), so the layers are the
single-GPU ones with fewer heads and rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ember.config import ModelConfig
from ember.models.checkpoint_layout import LAYER_PREFIX

# The architectures served at tensor_parallel_size > 1: the Llama family, dense and with
# experts.
TENSOR_PARALLEL_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration",
)
# MXFP4 weights hold one scale per 32 values along their input: a rank's slice of the down
# projection's input (the experts' intermediate rows) must be whole groups.
MXFP4_GROUP = 32

_COLUMN_SHARDS = ("self_attn.q_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_KV_SHARDS = ("self_attn.k_proj.", "self_attn.v_proj.")
_ROW_SHARDS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
# One value per query head (gpt-oss's attention sinks): cut with the heads.
_PER_HEAD = "self_attn.sinks"
# What a column-parallel projection holds one row of per output row.
_PER_ROW = ("weight", "bias", "weight_scale")


@dataclass(frozen=True)
class TensorSlice:
    """The part of a checkpoint tensor one rank reads: ``length`` indices of dimension ``dim``
    from ``start``, in each of its ``parts`` equal parts (2: gate and up stacked along one
    dimension, each cut alike)."""

    dim: int
    start: int
    length: int
    parts: int = 1

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This slice of ``tensor`` (a view; a source read whole keeps its rank's part)."""
        if self.parts == 1:
            return tensor.narrow(self.dim, self.start, self.length)
        split = tensor.unflatten(self.dim, (self.parts, -1))
        return split.narrow(self.dim + 1, self.start, self.length).flatten(self.dim, self.dim + 1)


@dataclass(frozen=True)
class Split:
    """Where a checkpoint tensor holds a dimension the ranks split evenly (an MLP's or an
    expert's intermediate rows): along ``dim``, in ``parts`` equal parts (2: gate and up stacked
    along it, gate first), each rank taking its ``1 / size`` of every part."""

    dim: int
    parts: int = 1

    def slice_for(self, shape: tuple[int, ...], rank: int, size: int) -> TensorSlice:
        """Rank ``rank`` of ``size``'s slice of a tensor of ``shape``."""
        length = shape[self.dim] // self.parts // size
        return TensorSlice(self.dim, rank * length, length, self.parts)


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """ValueError saying why ``cfg`` cannot be split over ``size`` ranks, if it cannot."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, not {size}")
    if size == 1:
        return
    if cfg.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ValueError(
            f"tensor_parallel_size={size}: ember does not split {cfg.architecture} over GPUs "
            "yet; tensor parallelism serves " + ", ".join(TENSOR_PARALLEL_ARCHITECTURES)
        )
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"num_key_value_heads={kv} (nor does {size} divide by it)")
    if _has_dense_mlp(cfg) and cfg.intermediate_size % size:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % size:
        problems.append(f"experts' intermediate size {cfg.moe_intermediate_size}")
    if cfg.shared_expert_intermediate_size % size:
        shared = cfg.shared_expert_intermediate_size
        problems.append(f"shared expert's intermediate size {shared}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's " + ", ".join(problems)
        )
    per_rank = cfg.moe_intermediate_size // size
    if cfg.mxfp4_experts and per_rank % MXFP4_GROUP:
        raise ValueError(
            f"tensor_parallel_size={size}: MXFP4 experts need each rank's share of their "
            f"intermediate size to be a multiple of {MXFP4_GROUP} (the down projection's scale "
            f"groups along its input), but {cfg.moe_intermediate_size} / {size} = {per_rank}; "
            f"choose a size that leaves a multiple of {MXFP4_GROUP}"
        )


def _has_dense_mlp(cfg: ModelConfig) -> bool:
    """Whether some decoder layer's MLP is dense (of ``intermediate_size``)."""
    return not all(cfg.is_moe_layer(layer) for layer in range(cfg.num_layers))


def rank_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's share: its query heads, KV heads, MLP rows and every expert's
    rows (the same on every rank); ``cfg`` itself at size 1."""
    if size == 1:
        return cfg
    check_shardable(cfg, size)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=max(1, cfg.num_kv_heads // size),
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=cfg.moe_intermediate_size // size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size,
    )


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embeddings and output head each rank holds (the last one's tail padding)."""
    return -(-vocab_size // size)


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """The first vocabulary id rank ``rank`` holds, and how many real ids it holds."""
    rows = vocab_rows(vocab_size, size)
    start = min(rank * rows, vocab_size)
    return start, min(rows, vocab_size - start)


def first_kv_head(cfg: ModelConfig, rank: int, size: int) -> int:
    """The first of the KV heads rank ``rank`` holds (of ``cfg``, the whole model's)."""
    kv = cfg.num_kv_heads
    return rank * kv // size if kv >= size else rank // (size // kv)


def tensor_slice(
    cfg: ModelConfig, hf_name: str, shape: tuple[int, ...], rank: int, size: int
) -> TensorSlice | None:
    """The slice of checkpoint tensor ``hf_name`` (of ``shape``, a Llama-family name) that rank
    ``rank`` of ``size`` reads for ``cfg`` (the whole model's config); None: all of it (norms,
    the row-parallel projections' output-side tensors, scalar scales, routers). Expert tensors
    are the model's to cut (its ``tensor_slice``)."""
    if size == 1:
        return None
    if hf_name in _VOCAB_TENSORS:
        start, count = vocab_range(cfg.vocab_size, rank, size)
        return TensorSlice(0, start, count)
    if not hf_name.startswith(LAYER_PREFIX):
        return None
    suffix = hf_name.split(".", 3)[3]
    per_row = suffix.rsplit(".", 1)[-1] in _PER_ROW and len(shape) >= 1 and shape[0] > 1
    if (suffix.startswith(_COLUMN_SHARDS) and per_row) or suffix == _PER_HEAD:
        rows = shape[0] // size
        return TensorSlice(0, rank * rows, rows)
    if suffix.startswith(_KV_SHARDS) and per_row:
        local = rank_config(cfg, size).num_kv_heads * cfg.head_dim
        return TensorSlice(0, first_kv_head(cfg, rank, size) * cfg.head_dim, local)
    if suffix in _ROW_SHARDS:
        columns = shape[1] // size
        return TensorSlice(1, rank * columns, columns)
    return None
