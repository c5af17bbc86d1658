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


def llama4_text(**fields) -> dict:
    return {
        **BASE,
        "intermediate_size": 24,
        "intermediate_size_mlp": 96,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        **fields,
    }


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"interleave_moe_layer_step": 2},
        {"interleave_moe_layer_step": 4},
        {"moe_layers": [0, 5]},
    ],
    ids=["every-layer", "step-2", "step-4", "listed"],
)
def test_llama4_sparse_layers_and_sizes_as_transformers_decides(fields):
    transformers = pytest.importorskip("transformers")
    config = llama4_text(**fields)
    cfg = ModelConfig.from_hf_dict({**config, "architectures": ["Llama4ForCausalLM"]})
    theirs = transformers.Llama4TextConfig(**config).moe_layers
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == theirs
    # Experts and the shared expert of intermediate_size, dense layers of intermediate_size_mlp.
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (24, 24)
    assert (cfg.intermediate_size, cfg.num_experts, cfg.num_experts_per_tok) == (96, 16, 1)


def test_a_multimodal_llama4_config_is_its_text_models():
    import dataclasses

    text = llama4_text(attention_chunk_size=32, eos_token_id=[7, 8])
    multimodal = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"hidden_size": 1408, "num_hidden_layers": 34},
        "tie_word_embeddings": False,
    }
    cfg = ModelConfig.from_hf_dict(multimodal)
    plain = ModelConfig.from_hf_dict({**text, "architectures": ["Llama4ForCausalLM"]})
    assert cfg.architecture == "Llama4ForConditionalGeneration"
    assert cfg == dataclasses.replace(plain, architecture=cfg.architecture)
    assert cfg.eos_token_ids == (7, 8) and cfg.attention_of(0).chunk_size == 32
    with pytest.raises(ValueError, match="no 'text_config'"):
        ModelConfig.from_hf_dict({"architectures": ["Llama4ForConditionalGeneration"]})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_experts_per_tok": 2}, "num_experts_per_tok=2 is not supported"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_llama4_configs_ember_cannot_run_are_refused(fields, message):
    config = {**llama4_text(**fields), "architectures": ["Llama4ForCausalLM"]}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(config)


def test_llama4_reads_fp8_experts_one_by_one_and_float_ones_stacked():
    """An FP8 checkpoint's experts one tensor each beside their scales (llm-compressor's
    layout), the router without one; quantized at load, the float stacks transformers saves."""
    import dataclasses

    from ember.models.registry import model_class
    from ember.quantization import Fp8Scheme

    plain = ModelConfig.from_hf_dict({**llama4_text(), "architectures": ["Llama4ForCausalLM"]})
    layouts = {
        source: model_class(plain.architecture).checkpoint_layout(
            dataclasses.replace(plain, fp8=Fp8Scheme(from_checkpoint=source == "checkpoint"))
        )
        for source in ("checkpoint", "load")
    }
    layer = "model.layers.1.feed_forward"
    names = {source: set(layout.names()) for source, layout in layouts.items()}
    assert f"{layer}.experts.3.up_proj.weight_scale" in names["checkpoint"]
    assert f"{layer}.shared_expert.down_proj.weight_scale" in names["checkpoint"]
    assert f"{layer}.router.weight" in names["checkpoint"]
    assert f"{layer}.router.weight_scale" not in names["checkpoint"]
    assert f"{layer}.experts.gate_up_proj" not in names["checkpoint"]
    assert f"{layer}.experts.gate_up_proj" in names["load"]
    assert not any(name.endswith("_scale") for name in names["load"])


def gpt_oss(**fields) -> ModelConfig:
    """A gpt-oss config.json as OpenAI publishes them: only what differs from transformers'
    defaults may be left out."""
    config = {
        **BASE,
        "architectures": ["GptOssForCausalLM"],
        "num_local_experts": 8,
        "experts_per_token": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0},
        **fields,
    }
    return ModelConfig.from_hf_dict(config)


def test_gpt_oss_experts_and_attention_as_transformers_reads_them():
    cfg = gpt_oss()
    # OpenAI's name for the top k; the experts are of intermediate_size, every layer sparse.
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 96)
    assert all(cfg.is_moe_layer(i) for i in range(6))
    # attention_bias defaults to on and covers o_proj; theta defaults to 150000.
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.rope_theta == 150000.0
    # Without layer_types: sliding first, then alternating, a window of 128; sinks everywhere.
    assert [layer.window for layer in cfg.layer_attention] == [128, None] * 3
    assert all(layer.sinks for layer in cfg.layer_attention)


def test_gpt_oss_without_its_attention_bias_has_no_output_bias():
    cfg = gpt_oss(attention_bias=False)
    assert not cfg.attention_bias and not cfg.o_proj_bias


def test_only_gpt_oss_output_projection_takes_the_attention_bias():
    config = {**BASE, "architectures": ["Qwen2ForCausalLM"], "attention_bias": True}
    assert not ModelConfig.from_hf_dict(config).o_proj_bias


@pytest.mark.parametrize(("field", "value"), [("swiglu_limit", 10.0), ("swiglu_alpha", 1.0)])
def test_gpt_oss_with_another_swiglu_is_refused(field, value):
    with pytest.raises(ValueError, match=f"{field}={value} is not supported"):
        gpt_oss(**{field: value})
