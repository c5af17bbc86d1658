"""What each tensor-parallel rank holds of a model and reads of its checkpoint
(`ember.parallel.sharding`), from names and shapes alone."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.tiny_models import tiny_config

from ember.config import ModelConfig, engine_config
from ember.parallel.sharding import (
    TensorSlice,
    check_shardable,
    first_kv_head,
    rank_config,
    tensor_slice,
    vocab_range,
    vocab_rows,
)


def config(arch: str = "LlamaForCausalLM", **fields) -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_config(arch, **fields).to_dict())


def test_a_rank_holds_its_share_of_heads_and_rows():
    cfg = config(num_attention_heads=8, num_key_value_heads=4, intermediate_size=128)
    share = rank_config(cfg, 4)
    assert (share.num_heads, share.num_kv_heads, share.intermediate_size) == (2, 1, 32)
    assert (share.hidden_size, share.vocab_size, share.head_dim) == (64, cfg.vocab_size, 16)
    assert rank_config(cfg, 1) is cfg


def test_fewer_kv_heads_than_ranks_are_replicated():
    cfg = config(num_attention_heads=4, num_key_value_heads=2)
    assert rank_config(cfg, 4).num_kv_heads == 1
    assert [first_kv_head(cfg, rank, 4) for rank in range(4)] == [0, 0, 1, 1]
    assert [first_kv_head(cfg, rank, 2) for rank in range(2)] == [0, 1]


@pytest.mark.parametrize(
    ("arch", "fields", "size", "why"),
    [
        ("Qwen3MoeForCausalLM", {}, 2, "mixture-of-experts"),
        (
            "LlamaForCausalLM",
            {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
            4,
            "heads=6",
        ),
        (
            "LlamaForCausalLM",
            {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
            2,
            "heads=3",
        ),
        ("LlamaForCausalLM", {"intermediate_size": 130}, 4, "intermediate_size=130"),
    ],
)
def test_what_cannot_be_split_is_refused_with_why(arch, fields, size, why):
    with pytest.raises(ValueError, match=why):
        check_shardable(config(arch, **fields), size)


def test_a_size_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        engine_config("m", tensor_parallel_size=0)


def test_the_vocabulary_splits_into_equal_rows_the_last_padded():
    assert vocab_rows(10, 4) == 3
    assert [vocab_range(10, rank, 4) for rank in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert vocab_range(49152, 1, 2) == (24576, 24576)


def test_each_tensor_is_cut_where_its_layer_splits():
    cfg = config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    q, kv, inter, hidden = cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.hidden_size
    layer = "model.layers.1."

    def cut(name, shape, rank=1, size=2):
        return tensor_slice(cfg, name, shape, rank, size)

    assert cut(layer + "self_attn.q_proj.weight", (q, hidden)) == TensorSlice(0, q // 2, q // 2)
    assert cut(layer + "self_attn.q_proj.bias", (q,)) == TensorSlice(0, q // 2, q // 2)
    assert cut(layer + "self_attn.k_proj.weight", (kv, hidden)) == TensorSlice(0, 16, 16)
    assert cut(layer + "self_attn.v_proj.weight", (kv, hidden), 3, 4) == TensorSlice(0, 16, 16)
    assert cut(layer + "self_attn.o_proj.weight", (hidden, q)) == TensorSlice(1, q // 2, q // 2)
    assert cut(layer + "mlp.up_proj.weight", (inter, hidden)) == TensorSlice(0, 64, 64)
    assert cut(layer + "mlp.gate_proj.weight_scale", (inter, 1)) == TensorSlice(0, 64, 64)
    assert cut(layer + "mlp.down_proj.weight", (hidden, inter)) == TensorSlice(1, 64, 64)
    uneven = dataclasses.replace(cfg, vocab_size=49155)
    assert tensor_slice(uneven, "lm_head.weight", (49155, hidden), 1, 2) == TensorSlice(
        0, 24578, 24577
    )
    # Whole on every rank: norms, a row-parallel projection's output side, scalar scales.
    for name, shape in [
        (layer + "input_layernorm.weight", (hidden,)),
        (layer + "self_attn.o_proj.weight_scale", (hidden, 1)),
        (layer + "self_attn.q_proj.weight_scale", ()),
        (layer + "self_attn.k_scale", ()),
        ("model.norm.weight", (hidden,)),
    ]:
        assert cut(name, shape) is None, name
    assert tensor_slice(cfg, layer + "self_attn.q_proj.weight", (q, hidden), 0, 1) is None
