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
  head (the last rank's tail is padding, zero), looks up the ids it holds and the ranks sum.

A rank's model is built from the config of its share (`rank_config`), so the layers are the
single-GPU ones with fewer heads and rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ember.config import ModelConfig
from ember.models.checkpoint_layout import LAYER_PREFIX

# The architectures served at tensor_parallel_size > 1: the dense Llama family.
TENSOR_PARALLEL_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_COLUMN_SHARDS = ("self_attn.q_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_KV_SHARDS = ("self_attn.k_proj.", "self_attn.v_proj.")
_ROW_SHARDS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
# What a column-parallel projection holds one row of per output row.
_PER_ROW = ("weight", "bias", "weight_scale")


@dataclass(frozen=True)
class TensorSlice:
    """The part of a checkpoint tensor one rank reads: ``length`` indices of dimension ``dim``
    from ``start``."""

    dim: int
    start: int
    length: int


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """ValueError saying why ``cfg`` cannot be split over ``size`` ranks, if it cannot."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, not {size}")
    if size == 1:
        return
    if cfg.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        kind = "a mixture-of-experts model" if cfg.num_experts else "this architecture"
        raise ValueError(
            f"tensor_parallel_size={size}: {cfg.architecture} is {kind}, which ember does not "
            "split over GPUs yet; tensor parallelism serves "
            + ", ".join(TENSOR_PARALLEL_ARCHITECTURES)
        )
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"num_key_value_heads={kv} (nor does {size} divide by it)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's " + ", ".join(problems)
        )


def rank_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's share: its query heads, KV heads and MLP rows (the same on
    every rank); ``cfg`` itself at size 1."""
    if size == 1:
        return cfg
    check_shardable(cfg, size)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=max(1, cfg.num_kv_heads // size),
        intermediate_size=cfg.intermediate_size // size,
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
    the row-parallel projections' output-side tensors, scalar scales)."""
    if size == 1:
        return None
    if hf_name in _VOCAB_TENSORS:
        start, count = vocab_range(cfg.vocab_size, rank, size)
        return TensorSlice(0, start, count)
    if not hf_name.startswith(LAYER_PREFIX):
        return None
    suffix = hf_name.split(".", 3)[3]
    per_row = suffix.rsplit(".", 1)[-1] in _PER_ROW and len(shape) >= 1 and shape[0] > 1
    if suffix.startswith(_COLUMN_SHARDS) and per_row:
        rows = shape[0] // size
        return TensorSlice(0, rank * rows, rows)
    if suffix.startswith(_KV_SHARDS) and per_row:
        local = rank_config(cfg, size).num_kv_heads * cfg.head_dim
        return TensorSlice(0, first_kv_head(cfg, rank, size) * cfg.head_dim, local)
    if suffix in _ROW_SHARDS:
        columns = shape[1] // size
        return TensorSlice(1, rank * columns, columns)
    return None
