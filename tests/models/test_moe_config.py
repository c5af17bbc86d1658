"""A mixture-of-experts config.json read into `ModelConfig`: the expert fields under each name
they are saved as, and which layers are sparse, as transformers decides."""

from __future__ import annotations

import pytest

from ember.config import ModelConfig

BASE = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def qwen3_moe(**fields) -> ModelConfig:
    config = {
        **BASE,
        "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 24,
        **fields,
    }
    return ModelConfig.from_hf_dict(config)


def test_qwen3_moe_as_published():
    cfg = qwen3_moe(norm_topk_prob=True)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (16, 4, 24)
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.head_dim == 32
    assert [cfg.is_moe_layer(i) for i in range(6)] == [True] * 6


def test_qwen3_moe_as_transformers_5_saves_it():
    """transformers 5 writes the expert count under Mixtral's name."""
    config = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 8}
    config.update(num_experts_per_tok=2, moe_intermediate_size=24)
    cfg = ModelConfig.from_hf_dict(config)
    assert cfg.num_experts == 8 and not cfg.norm_topk_prob


def test_qwen3_moe_dense_layers():
    cfg = qwen3_moe(mlp_only_layers=[0, 4], decoder_sparse_step=2)
    # Sparse: (i + 1) % 2 == 0 and not listed.
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    cfg = qwen3_moe(mlp_only_layers=[1, 4])
    assert [cfg.is_moe_layer(i) for i in range(6)] == [True, False, True, True, False, True]


def test_mixtral_experts_are_of_the_intermediate_size_and_renormalised():
    config = {**BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8}
    cfg = ModelConfig.from_hf_dict({**config, "num_experts_per_tok": 2})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 96)
    assert cfg.norm_topk_prob and not cfg.qk_norm
    assert all(cfg.is_moe_layer(i) for i in range(6))


def test_a_moe_config_without_an_expert_count_is_refused():
    config = {**BASE, "architectures": ["MixtralForCausalLM"], "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match="no num_experts / num_local_experts"):
        ModelConfig.from_hf_dict(config)


def test_dense_architectures_have_no_experts():
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"]})
    assert cfg.num_experts == 0 and not any(cfg.is_moe_layer(i) for i in range(6))


def fp8_layout(from_checkpoint: bool, weight_scales: str = "channel", stored=()):
    import dataclasses

    from ember.models.registry import model_class
    from ember.quantization import Fp8Scheme

    scheme = Fp8Scheme(from_checkpoint=from_checkpoint, weight_scales=weight_scales)
    cfg = dataclasses.replace(qwen3_moe(mlp_only_layers=[1]), fp8=scheme)
    return model_class(cfg.architecture).checkpoint_layout(cfg, stored)


def test_an_fp8_checkpoint_holds_a_scale_beside_each_experts_weights():
    layout = fp8_layout(from_checkpoint=True)
    expert = "model.layers.0.mlp.experts.15.down_proj"
    assert layout.shape_of(f"{expert}.weight") == (64, 24)
    assert layout.shape_of(f"{expert}.weight_scale") == frozenset({(64, 1), (64,)})
    assert layout.shape_of(f"{expert}.input_scale") == frozenset({(), (1,)})  # optional
    assert f"{expert}.input_scale" not in set(layout.names())
    assert layout.shape_of("model.layers.1.mlp.up_proj.weight_scale") == frozenset({(96, 1), (96,)})
    assert layout.shape_of("model.layers.0.mlp.gate.weight_scale") is None  # the router: float
    per_tensor = fp8_layout(from_checkpoint=True, weight_scales="tensor")
    assert per_tensor.shape_of(f"{expert}.weight_scale") == frozenset({(), (1,)})


def test_float_experts_quantized_at_load_hold_no_scales():
    layout = fp8_layout(from_checkpoint=False)
    assert layout.shape_of("model.layers.0.mlp.experts.0.gate_proj.weight_scale") is None
    stacked = fp8_layout(False, stored=["model.layers.0.mlp.experts.gate_up_proj"])
    assert stacked.shape_of("model.layers.0.mlp.experts.gate_up_proj") == (16, 48, 64)


def test_fp8_experts_stored_stacked_are_refused():
    with pytest.raises(ValueError, match="FP8 experts stored stacked are not supported"):
        fp8_layout(True, stored=["model.layers.0.mlp.experts.gate_up_proj"])
