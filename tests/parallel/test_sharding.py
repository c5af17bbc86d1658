"""What each tensor-parallel rank holds of a model and reads of its checkpoint
(`ember.parallel.sharding`), from names and shapes alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.tiny_models import tiny_config

from ember.bench.make_model import hf_config
from ember.config import ModelConfig, engine_config
from ember.models.registry import model_class
from ember.parallel.group import ShapeGroup
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


def packed(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its experts held in MXFP4, as a plan of an MXFP4 checkpoint makes it."""
    return dataclasses.replace(cfg, mxfp4_experts=True)


def rank_model(cfg: ModelConfig, rank: int, size: int):
    """Rank ``rank`` of ``size``'s model of ``cfg`` on the meta device (its slices by name)."""
    with torch.device("meta"):
        return model_class(cfg.architecture)(cfg, _Ops(), None, ShapeGroup(rank, size))


class _Ops:
    defer_norms = False


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
        ("Qwen3MoeForCausalLM", {"moe_intermediate_size": 34}, 4, "experts' intermediate size"),
        ("Llama4ForCausalLM", {"intermediate_size": 34}, 4, "shared expert's intermediate"),
        ("Llama4ForCausalLM", {"intermediate_size_mlp": 130}, 4, "intermediate_size=130"),
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


def test_a_dense_size_that_no_layer_uses_is_not_checked():
    """Qwen3-MoE's ``intermediate_size`` sizes only the dense MLPs of ``mlp_only_layers``."""
    cfg = config("Qwen3MoeForCausalLM", intermediate_size=130)
    check_shardable(cfg, 4)
    with pytest.raises(ValueError, match="intermediate_size=130"):
        check_shardable(
            config("Qwen3MoeForCausalLM", intermediate_size=130, mlp_only_layers=[0]), 4
        )


def test_mxfp4_experts_need_whole_scale_groups_per_rank():
    """Each rank's share of the experts' rows is the down projection's input: whole groups of
    32 columns, each with its scale. gpt-oss-120b (2880 rows) splits over 2 GPUs, not 4."""
    cfg = packed(config("GptOssForCausalLM", intermediate_size=192))
    check_shardable(cfg, 2)
    with pytest.raises(ValueError, match=r"multiple of 32 .* 192 / 4 = 48"):
        check_shardable(cfg, 4)
    check_shardable(dataclasses.replace(cfg, mxfp4_experts=False), 4)  # float experts: any rows
    big = packed(ModelConfig.from_hf_dict(hf_config("gpt-oss-120b", "mxfp4")))
    check_shardable(big, 2)
    with pytest.raises(ValueError, match="2880 / 4 = 720"):
        check_shardable(big, 4)


def test_a_rank_holds_every_expert_with_its_share_of_rows():
    cfg = config("Llama4ForCausalLM", intermediate_size=32, intermediate_size_mlp=128)
    share = rank_config(cfg, 4)
    assert (share.num_experts, share.num_experts_per_tok) == (cfg.num_experts, 1)
    assert (share.moe_intermediate_size, share.shared_expert_intermediate_size) == (8, 8)
    assert share.intermediate_size == 32
    mlp = rank_model(cfg, 3, 4).layers[1].mlp
    assert tuple(mlp.w13.shape) == (cfg.num_experts, 16, cfg.hidden_size)
    assert tuple(mlp.w2.shape) == (cfg.num_experts, cfg.hidden_size, 8)
    assert tuple(mlp.gate.weight.shape) == (cfg.num_experts, cfg.hidden_size)  # the whole router


def test_the_experts_down_biases_are_held_by_rank_zero_alone():
    """gpt-oss adds each expert's down bias inside its partial sum: once over the ranks."""
    cfg = config("GptOssForCausalLM")
    assert rank_model(cfg, 0, 2).layers[0].mlp.b2 is not None
    assert rank_model(cfg, 1, 2).layers[0].mlp.b2 is None
    assert rank_model(cfg, 1, 2).layers[0].mlp.b13.shape[1] == cfg.moe_intermediate_size


def test_each_expert_tensor_is_cut_along_its_intermediate_rows():
    """Rank 1 of 2, under each family's checkpoint names: the gate rows and the matching up
    rows (two runs where they are stacked, gate first; one where interleaved), the down
    projection's matching columns; routers, down scales and down biases whole."""
    layer = "model.layers.0."
    qwen = config("Qwen3MoeForCausalLM", moe_intermediate_size=32)
    e, h, i = qwen.num_experts, qwen.hidden_size, 32
    cut = rank_model(qwen, 1, 2).tensor_slice
    expert = layer + "mlp.experts.3."
    assert cut(expert + "gate_proj.weight", (i, h)) == TensorSlice(0, 16, 16)
    assert cut(expert + "up_proj.weight_scale", (i, 1)) == TensorSlice(0, 16, 16)
    assert cut(expert + "down_proj.weight", (h, i)) == TensorSlice(1, 16, 16)
    assert cut(expert + "down_proj.weight_scale", (h, 1)) is None
    assert cut(expert + "gate_proj.weight_scale", ()) is None
    assert cut(layer + "mlp.gate.weight", (e, h)) is None
    stacked = layer + "mlp.experts."
    assert cut(stacked + "gate_up_proj", (e, 2 * i, h)) == TensorSlice(1, 16, 16, parts=2)
    assert cut(stacked + "down_proj", (e, h, i)) == TensorSlice(2, 16, 16)
    mixtral = config("MixtralForCausalLM")
    i = mixtral.moe_intermediate_size
    cut = rank_model(mixtral, 1, 2).tensor_slice
    expert = layer + "block_sparse_moe.experts.0."
    assert cut(expert + "w3.weight", (i, h)) == TensorSlice(0, i // 2, i // 2)
    assert cut(expert + "w2.weight", (h, i)) == TensorSlice(1, i // 2, i // 2)
    assert cut(layer + "block_sparse_moe.gate.weight", (8, h)) is None
    oss = config("GptOssForCausalLM")
    i, heads = oss.moe_intermediate_size, oss.num_heads
    cut = rank_model(oss, 1, 2).tensor_slice
    experts = layer + "mlp.experts."
    assert cut(experts + "gate_up_proj", (e, h, 2 * i)) == TensorSlice(2, i, i)
    assert cut(experts + "gate_up_proj_bias", (e, 2 * i)) == TensorSlice(1, i, i)
    assert cut(experts + "gate_up_proj_blocks", (e, 2 * i, h // 32, 16)) == TensorSlice(1, i, i)
    assert cut(experts + "down_proj", (e, i, h)) == TensorSlice(1, i // 2, i // 2)
    groups = i // 32
    assert cut(experts + "down_proj_scales", (e, h, groups)) == TensorSlice(
        2, groups // 2, groups // 2
    )
    assert cut(experts + "down_proj_bias", (e, h)) is None
    assert cut(layer + "mlp.router.bias", (e,)) is None
    assert cut(layer + "self_attn.sinks", (heads,)) == TensorSlice(0, heads // 2, heads // 2)
    scout = config("Llama4ForConditionalGeneration", intermediate_size=32)
    cut = rank_model(scout, 1, 2).tensor_slice
    text = "language_model.model.layers.1.feed_forward."
    assert cut(text + "experts.gate_up_proj", (e, h, 64)) == TensorSlice(2, 16, 16, parts=2)
    assert cut(text + "experts.down_proj", (e, 32, h)) == TensorSlice(1, 16, 16)
    assert cut(text + "shared_expert.up_proj.weight", (32, h)) == TensorSlice(0, 16, 16)
    assert cut(text + "shared_expert.down_proj.weight", (h, 32)) == TensorSlice(1, 16, 16)
    assert cut(text + "router.weight", (e, h)) is None
    dense = "language_model.model.layers.0.feed_forward."
    assert cut(dense + "down_proj.weight", (h, 128)) == TensorSlice(1, 64, 64)
    vocab = scout.vocab_size
    assert cut("language_model.lm_head.weight", (vocab, h)) == TensorSlice(
        0, vocab // 2, vocab // 2
    )


def test_a_slice_in_two_parts_takes_the_same_rows_of_each():
    """Gate and up stacked along one dimension: rank 1 of 2 takes rows 2-3 of each half."""
    stacked = torch.arange(2 * 8 * 3).view(2, 8, 3)
    part = TensorSlice(1, 2, 2, parts=2)
    assert torch.equal(part.of(stacked), stacked[:, [2, 3, 6, 7]])
    assert torch.equal(TensorSlice(2, 1, 1).of(stacked), stacked[:, :, 1:2])


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
