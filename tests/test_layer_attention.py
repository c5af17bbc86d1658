"""Each layer's attention read from a Hugging Face config as transformers resolves it: sliding
windows (Mistral, Qwen2 with use_sliding_window and max_window_layers, gpt-oss alternating),
chunks, NoPE layers, QK norm and temperature tuning (Llama 4), sinks (gpt-oss)."""

from __future__ import annotations

import pytest

from ember.config import ModelConfig
from ember.layer_attention import (
    PLAIN,
    AttentionTemperature,
    LayerAttention,
    layer_attention_from_hf,
)

transformers = pytest.importorskip("transformers")


def _hf_dict(config_class, **fields) -> dict:
    """config.json as transformers writes it, with the fields it resolves (layer_types)."""
    return config_class(num_hidden_layers=6, **fields).to_dict()


def _kinds(layers: tuple[LayerAttention, ...], num_layers: int = 6) -> list[str]:
    if len(layers) <= 1:  # one entry (or none: plain) for every layer
        layers = (layers[0] if layers else PLAIN,) * num_layers
    return [
        "sliding_attention"
        if a.window is not None
        else "chunked_attention"
        if a.chunk_size is not None
        else "full_attention"
        for a in layers
    ]


def test_mistral_windows_every_layer_or_none():
    layers = layer_attention_from_hf(
        _hf_dict(transformers.MistralConfig, sliding_window=12), "MistralForCausalLM"
    )
    assert layers == (LayerAttention(window=12),)  # one for every layer
    no_window = _hf_dict(transformers.MistralConfig, sliding_window=None)
    assert layer_attention_from_hf(no_window, "MistralForCausalLM") == ()


@pytest.mark.parametrize("use_sliding_window", [True, False])
def test_qwen2_windows_the_layers_transformers_does(use_sliding_window):
    cfg = _hf_dict(
        transformers.Qwen2Config,
        use_sliding_window=use_sliding_window,
        sliding_window=32,
        max_window_layers=4,
    )
    layers = layer_attention_from_hf(cfg, "Qwen2ForCausalLM")
    assert _kinds(layers) == (
        transformers.Qwen2Config(**cfg).layer_types
        if use_sliding_window
        else ["full_attention"] * 6
    )
    assert _kinds(layers).count("sliding_attention") == (2 if use_sliding_window else 0)
    # A config.json without layer_types (older files) resolves the same way.
    del cfg["layer_types"]
    assert layer_attention_from_hf(cfg, "Qwen2ForCausalLM") == layers


def test_gpt_oss_alternates_windows_with_sinks_everywhere():
    cfg = _hf_dict(transformers.GptOssConfig, sliding_window=128)
    layers = layer_attention_from_hf(cfg, "GptOssForCausalLM")
    assert _kinds(layers) == transformers.GptOssConfig(**cfg).layer_types
    assert [a.window for a in layers] == [128, None] * 3
    assert all(a.sinks and a.use_rope for a in layers)


def test_llama4_chunks_its_rope_layers_and_tunes_the_others():
    cfg = _hf_dict(
        transformers.Llama4TextConfig, attention_chunk_size=64, floor_scale=16, attn_scale=0.2
    )
    layers = layer_attention_from_hf(cfg, "Llama4ForCausalLM")
    assert _kinds(layers) == transformers.Llama4TextConfig(**cfg).layer_types
    assert [a.use_rope for a in layers] == [True, True, True, False, True, True]
    nope = layers[3]
    assert nope == LayerAttention(use_rope=False, temperature=AttentionTemperature(16.0, 0.2))
    assert layers[0] == LayerAttention(chunk_size=64, qk_l2_norm_eps=cfg["rms_norm_eps"])
    # Without the defaults' layer_types: the same layers from no_rope_layers alone.
    del cfg["layer_types"]
    assert layer_attention_from_hf(cfg, "Llama4ForCausalLM") == layers
    cfg.update(use_qk_norm=False, attn_temperature_tuning=False)
    plainer = layer_attention_from_hf(cfg, "Llama4ForCausalLM")
    assert all(a.qk_l2_norm_eps is None and a.temperature is None for a in plainer)


def test_model_config_carries_the_layers():
    cfg = _hf_dict(transformers.MistralConfig, sliding_window=12)
    cfg["architectures"] = ["MistralForCausalLM"]
    model = ModelConfig.from_hf_dict(cfg)
    assert model.attention_of(5).window == 12
    llama = dict(cfg, architectures=["LlamaForCausalLM"])
    assert ModelConfig.from_hf_dict(llama).attention_of(0) == PLAIN


def test_only_a_model_windowed_in_every_layer_has_a_kv_window():
    """The window whose passed blocks a sequence gives back (`KVCacheManager`): every layer
    windowed (the largest window), none where a layer reads every key or a chunk's."""
    mistral = _hf_dict(transformers.MistralConfig, sliding_window=12)
    mistral["architectures"] = ["MistralForCausalLM"]
    assert ModelConfig.from_hf_dict(mistral).kv_window(4096) == 12
    assert ModelConfig.from_hf_dict(mistral).kv_window(12) is None  # the window hides nothing
    gpt_oss = _hf_dict(transformers.GptOssConfig, sliding_window=128)
    gpt_oss["architectures"] = ["GptOssForCausalLM"]
    assert ModelConfig.from_hf_dict(gpt_oss).kv_window(4096) is None  # alternate full layers
    llama = dict(mistral, architectures=["LlamaForCausalLM"])
    assert ModelConfig.from_hf_dict(llama).kv_window(4096) is None


def test_a_config_of_alike_layers_is_read_without_walking_them():
    """A config claiming a billion layers (the loader then refuses it against the checkpoint)
    costs nothing to read where its layers are alike."""
    huge = {"num_hidden_layers": 10**9, "sliding_window": 8}
    assert layer_attention_from_hf(huge, "MistralForCausalLM") == (LayerAttention(window=8),)
    assert layer_attention_from_hf(huge, "LlamaForCausalLM") == ()


def test_a_window_as_long_as_every_sequence_is_dropped():
    layer = LayerAttention(window=256)
    assert layer.within(256).window is None
    assert layer.within(257).window == 256
    assert layer.within(0) == layer  # unknown length: kept
    assert LayerAttention(chunk_size=64).within(64).chunk_size is None


def test_impossible_layers_are_refused():
    with pytest.raises(ValueError, match="not both"):
        LayerAttention(window=4, chunk_size=8)
    with pytest.raises(ValueError, match="NoPE"):
        LayerAttention(temperature=AttentionTemperature(8192.0, 0.1))
    with pytest.raises(ValueError, match="layer types"):
        bad = {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]}
        layer_attention_from_hf(bad, "GptOssForCausalLM")
