"""The FP8 form a checkpoint's quantization_config (and ``--quantization``) gives a model: both
layouts users have, quantize-at-load, and a clear refusal of every form ember cannot load."""

from __future__ import annotations

import copy

import pytest
from helpers.fp8_checkpoints import COMPRESSED_TENSORS, PLAIN_FP8

from ember.quantization import Fp8Scheme, fp8_scheme


def compressed(**changes) -> dict:
    """A compressed-tensors FP8 config (per channel, dynamic per-token activations); ``changes``
    replace keys of its one group's weights (``weights_``), activations (``activations_``) or
    the config itself."""
    config = copy.deepcopy(COMPRESSED_TENSORS)
    group = config["config_groups"]["group_0"]
    for key, value in changes.items():
        if key.startswith("weights_"):
            group["weights"][key.removeprefix("weights_")] = value
        elif key.startswith("activations_"):
            group["input_activations"][key.removeprefix("activations_")] = value
        else:
            config[key] = value
    return {"quantization_config": config}


def test_a_checkpoint_without_quantization_loads_as_it_is_unless_fp8_is_asked():
    assert fp8_scheme({}) is None
    assert fp8_scheme({}, "fp8") == Fp8Scheme(from_checkpoint=False, weight_scales="channel")


def test_compressed_tensors_fp8_per_channel_with_dynamic_activations():
    assert fp8_scheme(compressed()) == Fp8Scheme(
        from_checkpoint=True, weight_scales="channel", input_scales=False, kv_scales=False
    )


def test_compressed_tensors_per_tensor_static_activations_and_kv_scales():
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    config = compressed(
        weights_strategy="tensor",
        activations_strategy="tensor",
        activations_dynamic=False,
        kv_cache_scheme=kv,
    )
    assert fp8_scheme(config) == Fp8Scheme(True, "tensor", input_scales=True, kv_scales=True)


def test_an_older_compression_config_key_reads_the_same():
    config = compressed()
    assert fp8_scheme({"compression_config": config["quantization_config"]}) == fp8_scheme(config)


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_quant_method_fp8_is_per_tensor(scheme):
    config = {"quantization_config": {**PLAIN_FP8, "activation_scheme": scheme}}
    assert fp8_scheme(config) == Fp8Scheme(True, "tensor", input_scales=scheme == "static")


def test_asking_for_fp8_on_an_fp8_checkpoint_loads_it_as_it_is():
    """vLLM's flag on a checkpoint already in FP8: its own weights and scales, not requantized."""
    assert fp8_scheme(compressed(), "fp8") == fp8_scheme(compressed())


def test_gpt_oss_mxfp4_experts_leave_the_linear_layers_as_a_float_checkpoints():
    """quant_method mxfp4 quantizes only gpt-oss's experts (dequantized as they load): the
    linear layers are float, so FP8 comes only from --quantization fp8."""
    config = {"quantization_config": {"quant_method": "mxfp4"}}
    assert fp8_scheme(config) is None
    assert fp8_scheme(config, "fp8") == Fp8Scheme(from_checkpoint=False)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
            "block-wise FP8 scales",
        ),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq'"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq'"),
        ({"quantization_config": "fp8"}, "must be an object"),
        ({"quantization_config": {**PLAIN_FP8, "activation_scheme": "x"}}, "activation_scheme"),
        (compressed(format="pack-quantized"), "format 'pack-quantized'"),
        (compressed(weights_num_bits=4, weights_type="int"), "not 8-bit float"),
        (compressed(weights_strategy="block"), "strategy 'block'"),
        (compressed(weights_strategy="group"), "strategy 'group'"),
        (compressed(weights_dynamic=True), "dynamic scales"),
        (compressed(activations_type="int"), "input activations"),
        (compressed(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "leaves"),
        (compressed(kv_cache_scheme={"num_bits": 8, "type": "int"}), "kv_cache_scheme"),
    ],
)
def test_what_ember_cannot_load_is_refused_with_the_reason(config, message):
    with pytest.raises(ValueError, match=message):
        fp8_scheme(config)


@pytest.mark.parametrize(
    "routers",
    [
        ["re:.*mlp.gate$"],  # llm-compressor's Qwen MoE recipe
        ["re:.*block_sparse_moe.gate"],  # its Mixtral recipe
        ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"],  # each layer's, by name
    ],
)
def test_a_mixture_of_experts_may_leave_its_routers_in_float(routers):
    assert fp8_scheme(compressed(ignore=["lm_head", *routers])).from_checkpoint
    plain = {"quantization_config": {**PLAIN_FP8, "ignored_layers": ["lm_head", *routers]}}
    assert fp8_scheme(plain).weight_scales == "tensor"


@pytest.mark.parametrize(
    "ignored",
    [
        # llm-compressor's Llama 4 recipe, as patterns
        ["re:.*lm_head", "re:.*router", "re:.*vision_model.*", "re:.*multi_modal_projector.*"],
        # and module by module, under the multimodal checkpoint's names
        [
            "language_model.lm_head",
            "language_model.model.layers.0.feed_forward.router",
            "vision_model.model.layers.0.self_attn.q_proj",
            "vision_model.vision_adapter.mlp.fc1",
            "multi_modal_projector.linear_1",
        ],
    ],
)
def test_a_multimodal_llama4_may_leave_its_vision_tower_router_and_head_in_float(ignored):
    """ember reads the text model alone: what lies outside it may be in any form (a vision
    tower's attention too: the text model's stays FP8)."""
    scheme = fp8_scheme(compressed(ignore=ignored))
    assert scheme.from_checkpoint and not scheme.float_attention


@pytest.mark.parametrize(
    "attention",
    [
        ["re:.*self_attn", "Llama4TextAttention"],  # llm-compressor's Llama 4 recipes
        ["language_model.model.layers.0.self_attn.q_proj"],  # module by module
    ],
)
def test_a_checkpoint_may_leave_its_attention_in_float(attention):
    scheme = fp8_scheme(compressed(ignore=["re:.*lm_head", "re:.*router", *attention]))
    assert scheme.from_checkpoint and scheme.float_attention
    plain = {"quantization_config": {**PLAIN_FP8, "ignored_layers": ["lm_head", *attention]}}
    assert fp8_scheme(plain).float_attention


@pytest.mark.parametrize("module", ["re:.*gate_proj", "model.layers.0.mlp.experts.0.gate_proj"])
def test_an_unquantized_projection_named_like_a_router_is_refused(module):
    with pytest.raises(ValueError, match="leaves"):
        fp8_scheme(compressed(ignore=["lm_head", module]))


def test_two_config_groups_are_refused():
    config = compressed()
    groups = config["quantization_config"]["config_groups"]
    groups["group_1"] = copy.deepcopy(groups["group_0"])
    with pytest.raises(ValueError, match="2 compressed-tensors config groups"):
        fp8_scheme(config)


def test_an_unknown_requested_quantization_is_refused():
    with pytest.raises(ValueError, match="unknown quantization 'int8'"):
        fp8_scheme({}, "int8")
