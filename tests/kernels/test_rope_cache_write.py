"""RoPE tables vs transformers, and the fused rotate + cache-write kernel vs the reference."""

from __future__ import annotations

import pytest
import torch

from ember.config import RopeScaling
from ember.kernels.rope_cache_write import rope_and_cache_write
from ember.layers.reference_ops import build_cos_sin_cache, rope_and_cache_write_reference

LLAMA31_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _hf_cos_sin(head_dim, max_positions, theta, scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=rope,
    )
    positions = torch.arange(max_positions)[None, :]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0, :, : head_dim // 2], sin[0, :, : head_dim // 2]


@pytest.mark.parametrize("scaling", [None, LLAMA31_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cos_sin_cache_matches_transformers(scaling, head_dim):
    cache = build_cos_sin_cache(head_dim, 4096, 500000.0, scaling)
    cos, sin = _hf_cos_sin(head_dim, 4096, 500000.0, scaling)
    assert cache.dtype == torch.float32 and cache.shape == (4096, head_dim)
    torch.testing.assert_close(cache[:, : head_dim // 2], cos, rtol=0, atol=0)
    torch.testing.assert_close(cache[:, head_dim // 2 :], sin, rtol=0, atol=0)


def test_llama3_inv_freq_matches_transformers_helper():
    """The scaled frequencies themselves, against `_compute_llama3_parameters`."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    config = LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        head_dim=128,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    inv_freq, _ = _compute_llama3_parameters(config)
    ours = build_cos_sin_cache(128, 2, 500000.0, LLAMA31_SCALING)
    # Row 1 is position 1: cos(inv_freq), sin(inv_freq).
    torch.testing.assert_close(ours[1, :64], inv_freq.cos(), rtol=0, atol=0)
    torch.testing.assert_close(ours[1, 64:], inv_freq.sin(), rtol=0, atol=0)


def test_reference_rotation_matches_transformers(gen):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tokens, heads, head_dim = 7, 3, 64
    cache = build_cos_sin_cache(head_dim, 64, 10000.0, None)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k = torch.randn(tokens, 1, head_dim, generator=gen)
    cos = cache[positions, : head_dim // 2].repeat(1, 2)[None]
    sin = cache[positions, head_dim // 2 :].repeat(1, 2)[None]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    k_cache = torch.zeros(4, 4, 1, head_dim)
    rope_and_cache_write_reference(
        q, k, k.clone(), positions, cache, torch.arange(tokens), k_cache, k_cache.clone()
    )
    torch.testing.assert_close(q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "dtype"),
    [(4, 4, 64, torch.float32), (8, 2, 128, torch.bfloat16), (6, 1, 64, torch.bfloat16)],
)
def test_kernel_matches_reference(gen, device, num_q_heads, num_kv_heads, head_dim, dtype):
    """q/k/v are views of one fused qkv buffer; some tokens are padding (slot -1)."""
    tokens, page, num_blocks = 9, 4, 6
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(dtype)
    cos_sin = build_cos_sin_cache(head_dim, 128, 10000.0, LLAMA31_SCALING)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * page, generator=gen)[:tokens]
    slots[[2, 7]] = -1
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)

    def split(buffer):
        q, k, v = buffer.split(
            [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
        )
        return (
            q.view(tokens, num_q_heads, head_dim),
            k.view(tokens, num_kv_heads, head_dim),
            v.view(tokens, num_kv_heads, head_dim),
        )

    expected_qkv, expected_k_cache, expected_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    rope_and_cache_write_reference(
        *split(expected_qkv), positions, cos_sin, slots, expected_k_cache, expected_v_cache
    )

    got_qkv, got_k_cache, got_v_cache = (t.to(device) for t in (qkv, k_cache, v_cache))
    rope_and_cache_write(
        *split(got_qkv),
        positions.to(device),
        cos_sin.to(device),
        slots.to(device),
        got_k_cache,
        got_v_cache,
    )

    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got_qkv.cpu(), expected_qkv, **tol)
    torch.testing.assert_close(got_k_cache.cpu(), expected_k_cache, **tol)
    # v is copied, not computed: bit-exact, and slots -1 and untouched slots keep their values.
    assert torch.equal(got_v_cache.cpu(), expected_v_cache)
    written = torch.zeros(num_blocks * page, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched = ~written.view(num_blocks, page)
    assert torch.equal(got_k_cache.cpu()[untouched], k_cache[untouched])
