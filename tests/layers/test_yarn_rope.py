"""YaRN RoPE ("yarn" rope_type, gpt-oss): the cos/sin table ember builds from a config equals
transformers' rotary embedding's, attention factor included, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from ember.config import ModelConfig, YarnRopeScaling
from ember.layers.reference_ops import build_cos_sin_cache

transformers = pytest.importorskip("transformers")

HEAD_DIM, POSITIONS = 64, 600

# gpt-oss's published parameters, then variants reaching each of transformers' branches.
GPT_OSS = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
VARIANTS = {
    "gpt-oss": (GPT_OSS, 131072),
    "truncated-range": ({**GPT_OSS, "truncate": True}, 131072),
    "defaults-small-context": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
        },
        512,
    ),
    "mscale": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128,
        },
        512,
    ),
    "attention-factor-given": ({**GPT_OSS, "attention_factor": 0.9}, 131072),
}


# OpenAI's gpt-oss-20b config.json, but for its layer count.
PUBLISHED = {
    "architectures": ["GptOssForCausalLM"],
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 2,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "experts_per_token": 4,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {k: v for k, v in GPT_OSS.items() if k != "rope_theta"},
}


def hf_config(rope: dict, max_positions: int):
    return transformers.GptOssConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        num_hidden_layers=2,
        max_position_embeddings=max_positions,
        rope_parameters=dict(rope),
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_table_equals_transformers_rotary_embedding(variant):
    config = hf_config(*VARIANTS[variant])
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(config)
    with torch.no_grad():
        cos, sin = rotary(torch.zeros((), dtype=torch.float32), torch.arange(POSITIONS)[None])
    ours = ModelConfig.from_hf_dict({**config.to_dict(), "architectures": ["GptOssForCausalLM"]})
    assert isinstance(ours.rope_scaling, YarnRopeScaling)
    assert ours.rope_scaling.attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-15)
    table = build_cos_sin_cache(HEAD_DIM, POSITIONS, ours.rope_theta, ours.rope_scaling)
    assert torch.equal(table[:, : HEAD_DIM // 2], cos[0])
    assert torch.equal(table[:, HEAD_DIM // 2 :], sin[0])


def test_openai_published_config_reads_as_transformers_reads_it():
    """OpenAI's config.json: rope_theta at the top level, YaRN under rope_scaling."""
    cfg = ModelConfig.from_hf_dict(PUBLISHED)
    assert cfg.rope_theta == 150000.0
    assert cfg.rope_scaling == YarnRopeScaling(32.0, 4096, 32.0, 1.0, False, 0.1 * math.log(32) + 1)
    hf = transformers.GptOssConfig(**{k: v for k, v in PUBLISHED.items() if k != "architectures"})
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hf)
    with torch.no_grad():
        cos, _ = rotary(torch.zeros(()), torch.arange(8)[None])
    table = build_cos_sin_cache(cfg.head_dim, 8, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(table[:, :32], cos[0])


def test_yarn_without_a_factor_is_refused():
    config = {**PUBLISHED, "rope_scaling": {"rope_type": "yarn", "beta_fast": 32.0}}
    with pytest.raises(ValueError, match="without a factor"):
        ModelConfig.from_hf_dict(config)


def test_yarn_slows_the_low_frequencies_and_keeps_the_high_ones():
    cfg = hf_config(*VARIANTS["gpt-oss"])
    ours = ModelConfig.from_hf_dict({**cfg.to_dict(), "architectures": ["GptOssForCausalLM"]})
    plain = build_cos_sin_cache(HEAD_DIM, 2, ours.rope_theta, None)
    yarn = build_cos_sin_cache(HEAD_DIM, 2, ours.rope_theta, ours.rope_scaling)
    factor = ours.rope_scaling.attention_factor
    # Position 1's angle is the frequency itself: sin of it, unscaled by the attention factor.
    plain_freq = torch.asin(plain[1, HEAD_DIM // 2 :])
    yarn_freq = torch.asin(yarn[1, HEAD_DIM // 2 :] / factor)
    assert torch.allclose(yarn_freq[:2], plain_freq[:2])  # fast: kept
    torch.testing.assert_close(yarn_freq[-4:], plain_freq[-4:] / 32)  # slow: interpolated
