"""The FP8 KV cache's reference (docs/CONTRACTS.md, "FP8 KV cache"): a cache of float8 e4m3
stores ``clamp(x / scale, -448, 448)`` and reads ``stored * scale``, with one scale for keys and
one for values per layer; a cache of the model's dtype ignores the scales."""

from __future__ import annotations

import pytest
import torch

from ember.layers.reference_ops import (
    build_cos_sin_cache,
    dequantize_kv_reference,
    paged_attention_reference,
    quantize_kv_reference,
    rope_and_cache_write_reference,
)

FP8 = torch.float8_e4m3fn


def test_stored_values_are_divided_by_the_scale_and_read_back_multiplied():
    x = torch.tensor([1.0, -3.0, 0.0, 0.75])
    stored = quantize_kv_reference(x, 0.5)
    assert stored.dtype == FP8
    assert stored.float().tolist() == [2.0, -6.0, 0.0, 1.5]  # exact in e4m3
    assert dequantize_kv_reference(stored, 0.5).tolist() == x.tolist()


@pytest.mark.parametrize("scale", [0.37, 2.5])
def test_a_round_trip_keeps_fp8_e4m3_precision(scale):
    """e4m3 keeps 3 mantissa bits: a normal value comes back within half a step, 2**-4 of
    itself; below the normal range (2**-6 * scale) the step is fixed, 2**-9 * scale."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * torch.logspace(-4, 2, 4096)
    x = x[(x / scale).abs() <= 448]
    back = dequantize_kv_reference(quantize_kv_reference(x, scale), scale)
    bound = torch.maximum(x.abs() * 2**-4, torch.full_like(x, 2**-10 * scale))
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    # Not a looser format: the error reaches a good part of its bound somewhere.
    assert ((back - x).abs() / bound).max() > 0.75


@pytest.mark.parametrize("scale", [0.37, 2.5])
def test_values_past_the_range_clamp_to_448_times_the_scale(scale):
    x = torch.tensor([448.0 * scale * 1.5, -1e6, 1e30, -448.0 * scale])
    back = dequantize_kv_reference(quantize_kv_reference(x, scale), scale)
    limit = torch.tensor(448.0) * scale  # as float32 computes it
    assert back.tolist() == [limit.item(), -limit.item(), limit.item(), -limit.item()]


def _write(k_cache, v_cache, k, v, slots, kv_scales=(1.0, 1.0)):
    """Store k and v (already rotated: position 0 everywhere leaves them as they are)."""
    tokens, _, head_dim = k.shape
    q = torch.zeros(tokens, 1, head_dim)
    cos_sin = build_cos_sin_cache(head_dim, 4, 10000.0, None)
    positions = torch.zeros(tokens, dtype=torch.int64)
    rope_and_cache_write_reference(
        q, k.clone(), v.clone(), positions, cos_sin, slots, k_cache, v_cache, kv_scales=kv_scales
    )


def test_the_cache_write_quantizes_keys_and_values_by_their_own_scales():
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 3, 2, 16, generator=gen)
    k[0, 0, 0] = 1000.0  # past 448 * k_scale: clamped
    k_cache = torch.zeros(2, 4, 2, 16, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, -1, 0])
    _write(k_cache, v_cache, k, v, slots, kv_scales=(0.5, 3.0))
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[5].float(), quantize_kv_reference(k[0], 0.5).float())
    assert torch.equal(flat_v[0].float(), quantize_kv_reference(v[2], 3.0).float())
    assert flat_k[5, 0, 0].item() == 448.0
    assert flat_k[1:5].float().abs().sum() == 0  # slot -1 wrote nowhere


def _attend(q, k_cache, v_cache, q_lens, kv_scales=(1.0, 1.0)):
    """The reference's attention of ``q`` (sequences of ``q_lens`` query tokens, 11 and 6 keys)
    over blocks 3, 1, 5 and 2, 4 of the caches."""
    table = torch.tensor([[3, 1, 5], [2, 4, 0]], dtype=torch.int32)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([11, 6], dtype=torch.int32)
    return paged_attention_reference(
        q,
        k_cache,
        v_cache,
        starts,
        seq_lens,
        table,
        0.25,
        torch.empty_like(q),
        max_query_len=max(q_lens),
        max_seq_len=11,
        kv_scales=kv_scales,
    )


def test_attention_over_an_fp8_cache_reads_the_dequantized_values():
    """The reference's attention over an FP8 cache is its attention over a float32 cache
    holding ``stored * scale``: both the prefill (loop) and the decode (batched) form."""
    gen = torch.Generator().manual_seed(2)
    kv_scales = (0.37, 1.9)
    keys, values = torch.randn(2, 6, 4, 2, 16, generator=gen)
    k_fp8, v_fp8 = (quantize_kv_reference(t, s) for t, s in zip((keys, values), kv_scales))
    k_read, v_read = (dequantize_kv_reference(t, s) for t, s in zip((k_fp8, v_fp8), kv_scales))
    for q_lens in ([3, 2], [1, 1]):
        q = torch.randn(sum(q_lens), 4, 16, generator=gen)
        got = _attend(q, k_fp8, v_fp8, q_lens, kv_scales)
        torch.testing.assert_close(got, _attend(q, k_read, v_read, q_lens), rtol=0, atol=0)
        assert not torch.allclose(got, _attend(q, k_fp8, v_fp8, q_lens), atol=1e-2)


def test_a_cache_of_the_model_dtype_ignores_the_scales():
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 3, 2, 16, generator=gen)
    slots = torch.tensor([5, 2, 0])
    plain = [torch.zeros(6, 4, 2, 16) for _ in range(2)]
    scaled = [torch.zeros(6, 4, 2, 16) for _ in range(2)]
    _write(*plain, k, v, slots)
    _write(*scaled, k, v, slots, kv_scales=(0.5, 3.0))
    assert all(torch.equal(a, b) for a, b in zip(plain, scaled))
    assert plain[0].abs().sum() > 0
    q = torch.randn(4, 4, 16, generator=gen)
    assert torch.equal(_attend(q, *plain, [3, 1]), _attend(q, *plain, [3, 1], (0.5, 3.0)))
