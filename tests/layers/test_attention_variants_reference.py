"""The reference path's windows, chunks, sinks, NoPE layers, QK L2 norm and temperature tuning
(docs/CONTRACTS.md, "Windows, sinks, chunks"): against a token-by-token dense softmax, and
against the transformers functions that define them (its mask functions, gpt-oss's eager
attention, Llama 4's L2 norm and its NoPE layer)."""

from __future__ import annotations

import pytest
import torch

from ember.config import StepLimits
from ember.layer_attention import AttentionTemperature, LayerAttention
from ember.layers.attention import ReferenceAttention
from ember.layers.forward_context import ForwardContext
from ember.layers.reference_ops import (
    build_cos_sin_cache,
    first_visible_key,
    l2_normalize_heads_reference,
    paged_attention_reference,
    rms_norm_reference,
    rope_and_cache_write_reference,
)

transformers = pytest.importorskip("transformers")

HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 16, 4


def _cache_step(gen, q_lens, seq_lens):
    """q and a cache over shuffled blocks, as the attention kernels read them."""
    blocks = [-(-n // PAGE) for n in seq_lens]
    ids = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for seq, n in enumerate(blocks):
        table[seq, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    shape = (sum(blocks) + 1, PAGE, KV_HEADS, HEAD_DIM)
    return {
        "q": torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=gen),
        "k_cache": torch.randn(shape, generator=gen),
        "v_cache": torch.randn(shape, generator=gen),
        "query_start_loc": torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_tables": table,
        "max_query_len": max(q_lens),
        "max_seq_len": max(seq_lens),
    }


def _reference(step, **options):
    out = torch.full_like(step["q"], float("nan"))
    return paged_attention_reference(
        step["q"],
        step["k_cache"],
        step["v_cache"],
        step["query_start_loc"],
        step["seq_lens"],
        step["block_tables"],
        HEAD_DIM**-0.5,
        out,
        max_query_len=step["max_query_len"],
        max_seq_len=step["max_seq_len"],
        **options,
    )


def _dense(step, q_lens, seq_lens, first_key, sinks=None):
    """Token by token: softmax over keys first_key(pos)..pos, a sink joining its denominator."""
    out = torch.empty_like(step["q"])
    group = HEADS // KV_HEADS
    for seq, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        table = step["block_tables"][seq].long()
        for j in range(q_len):
            tok = int(step["query_start_loc"][seq]) + j
            pos = seq_len - q_len + j
            slots = [(int(table[p // PAGE]), p % PAGE) for p in range(first_key(pos), pos + 1)]
            for head in range(HEADS):
                keys = torch.stack([step["k_cache"][b, o, head // group] for b, o in slots])
                values = torch.stack([step["v_cache"][b, o, head // group] for b, o in slots])
                logits = keys @ step["q"][tok, head] * HEAD_DIM**-0.5
                weights = logits.exp()
                total = weights.sum() + (0.0 if sinks is None else sinks[head].exp())
                out[tok, head] = (weights / total) @ values
    return out


CASES = [([3, 1, 6], [20, 9, 6]), ([1, 1, 1], [17, 4, 30])]  # mixed, decode-only


@pytest.mark.parametrize(("q_lens", "seq_lens"), CASES)
@pytest.mark.parametrize(
    ("options", "first_key"),
    [
        ({"window": 5}, lambda p: max(0, p - 4)),
        ({"window": 1}, lambda p: p),
        ({"window": 64}, lambda p: 0),
        ({"chunk_size": 8}, lambda p: p // 8 * 8),
        ({}, lambda p: 0),
    ],
    ids=["window5", "window1", "window64", "chunk8", "causal"],
)
def test_windows_and_chunks_match_dense_attention(q_lens, seq_lens, options, first_key):
    step = _cache_step(torch.Generator().manual_seed(0), q_lens, seq_lens)
    expected = _dense(step, q_lens, seq_lens, first_key)
    torch.testing.assert_close(_reference(step, **options), expected)


@pytest.mark.parametrize(("q_lens", "seq_lens"), CASES)
def test_sinks_join_the_denominator_once(q_lens, seq_lens):
    gen = torch.Generator().manual_seed(1)
    step = _cache_step(gen, q_lens, seq_lens)
    sinks = torch.randn(HEADS, generator=gen) * 3
    expected = _dense(step, q_lens, seq_lens, lambda p: max(0, p - 6), sinks)
    got = _reference(step, window=7, sinks=sinks.to(torch.bfloat16).float())
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)  # sinks as bf16 holds them
    torch.testing.assert_close(_reference(step, window=7, sinks=sinks), expected)
    # A very negative sink takes no mass: plain attention.
    torch.testing.assert_close(_reference(step, sinks=torch.full((HEADS,), -1e4)), _reference(step))


def test_visible_keys_are_transformers_masks():
    """transformers' sliding-window and chunked mask functions, at every (query, key) pair."""
    from transformers.masking_utils import (
        causal_mask_function,
        chunked_causal_mask_function,
        sliding_window_causal_mask_function,
    )

    q_idx = torch.arange(70)[:, None]
    kv_idx = torch.arange(70)[None, :]
    zero = torch.tensor(0)
    for options, hf_mask in [
        ({"window": 1}, sliding_window_causal_mask_function(1)),
        ({"window": 13}, sliding_window_causal_mask_function(13)),
        ({"chunk_size": 16}, chunked_causal_mask_function(16, torch.zeros(1, dtype=torch.long))),
        ({}, causal_mask_function),
    ]:
        ours = (kv_idx >= first_visible_key(q_idx, **options)) & (kv_idx <= q_idx)
        assert torch.equal(ours, hf_mask(zero, zero, q_idx, kv_idx).expand(70, 70)), options


def test_sinks_match_gpt_oss_eager_attention():
    """gpt-oss's eager attention (its sinks concatenated to the logits, then dropped) over a
    sliding-window mask: the reference's output, to float32 precision."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(2)
    seq_len, window = 23, 6
    step = _cache_step(gen, [seq_len], [seq_len])
    sinks = torch.randn(HEADS, generator=gen)
    ours = _reference(step, window=window, sinks=sinks)

    table = step["block_tables"][0].long()
    keys = step["k_cache"][table].reshape(-1, KV_HEADS, HEAD_DIM)[:seq_len]
    values = step["v_cache"][table].reshape(-1, KV_HEADS, HEAD_DIM)[:seq_len]
    idx = torch.arange(seq_len)
    zero = torch.tensor(0)
    allowed = sliding_window_causal_mask_function(window)(zero, zero, idx[:, None], idx[None, :])
    mask = torch.zeros(seq_len, seq_len).masked_fill(~allowed, float("-inf"))
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, HEADS // KV_HEADS, False
    theirs, _ = eager_attention_forward(
        module,
        step["q"].transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        mask[None, None],
        scaling=HEAD_DIM**-0.5,
    )
    torch.testing.assert_close(ours, theirs[0])


def test_qk_l2_norm_is_llama4s():
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm

    x = torch.randn(5, 3, HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    torch.testing.assert_close(l2_normalize_heads_reference(x, 1e-5), Llama4TextL2Norm(1e-5)(x))


def test_a_nope_layer_writes_unrotated_keys_and_normalises_after_rope():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, n, HEAD_DIM, generator=gen) for n in (HEADS, KV_HEADS, KV_HEADS))
    positions = torch.tensor([5, 9, 17])
    cos_sin = build_cos_sin_cache(HEAD_DIM, 32, 10000.0, None)
    slots = torch.tensor([0, 1, 2])

    def write(**options):
        qq, kk = q.clone(), k.clone()
        caches = torch.zeros(2, 1, 4, KV_HEADS, HEAD_DIM)
        rope_and_cache_write_reference(
            qq, kk, v.clone(), positions, cos_sin, slots, caches[0], caches[1], **options
        )
        return qq, caches[0, 0, :3]

    q_nope, k_nope = write(use_rope=False)
    assert torch.equal(q_nope, q) and torch.equal(k_nope, k)
    q_rope, k_rope = write()
    q_norm, k_norm = write(qk_l2_norm_eps=1e-5)
    torch.testing.assert_close(q_norm, l2_normalize_heads_reference(q_rope, 1e-5))
    torch.testing.assert_close(k_norm, l2_normalize_heads_reference(k_rope, 1e-5))
    assert torch.allclose(q_norm.pow(2).mean(-1), torch.ones(3, HEADS), atol=1e-4)


def test_a_llama4_nope_layer_matches_transformers():
    """A Llama 4 NoPE layer with temperature tuning (floor_scale 4 puts positions past several
    floors) through ember's `Attention` on the reference backend, against
    `Llama4TextAttention` over a causal mask; the q/k/v and o weights are the same."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    from ember.config import ModelConfig
    from ember.layers.ops import reference_ops
    from ember.layers.residual import start_stream
    from ember.models.llama import Attention

    hf_config = transformers.Llama4TextConfig(
        hidden_size=32,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=4,
        floor_scale=4,
        attn_scale=0.3,
        no_rope_layers=[1, 1, 1, 0],
    )
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Llama4TextAttention(hf_config, layer_idx=3).eval()
    assert not hf.use_rope
    seq_len = 19
    hidden = torch.randn(seq_len, 32, generator=torch.Generator().manual_seed(5))
    normed = rms_norm_reference(hidden, torch.ones(32), 1e-5)  # what the layer's input norm gives
    causal = torch.full((seq_len, seq_len), float("-inf")).triu(1)
    with torch.no_grad():
        expected, _ = hf(normed[None], None, causal[None, None])

    cfg = ModelConfig("Llama4", 8, 32, 64, 4, HEADS, KV_HEADS, HEAD_DIM, 1e-5, 1e4, 64, False)
    layer = LayerAttention(use_rope=False, temperature=AttentionTemperature(4.0, 0.3))
    ops = reference_ops()
    attention = Attention(cfg, ops, ReferenceAttention(StepLimits(max_model_len=64)), layer)
    ctx = ForwardContext(
        positions=torch.arange(seq_len),
        slot_mapping=torch.arange(PAGE, PAGE + seq_len),
        query_start_loc=torch.tensor([0, seq_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.arange(1, 6, dtype=torch.int32)[None],
        max_query_len=seq_len,
        max_seq_len=seq_len,
    )
    caches = torch.zeros(2, 6, PAGE, KV_HEADS, HEAD_DIM)
    with torch.no_grad():
        attention.qkv_proj.weight.copy_(
            torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight])
        )
        attention.o_proj.weight.copy_(hf.o_proj.weight)
        stream = start_stream(ops, hidden, 1e-5, deferred=False)
        # No RoPE table: a NoPE layer never reads one.
        got = attention(stream, torch.ones(32), ctx, torch.empty(0, HEAD_DIM), *caches)
    torch.testing.assert_close(got.pending, expected[0], atol=1e-5, rtol=1e-5)


def test_layers_pass_their_kind_as_options_and_own_their_sinks():
    """A gpt-oss-like layer (window, sinks) owns ``sinks`` as a parameter the checkpoint fills
    (``self_attn.sinks``) and passes it with its window; a plain layer passes nothing."""
    import dataclasses

    from ember.config import ModelConfig
    from ember.layers.ops import reference_ops
    from ember.models.llama import LlamaForCausalLM

    cfg = ModelConfig("GptOss", 8, 32, 64, 2, HEADS, KV_HEADS, HEAD_DIM, 1e-5, 1e4, 64, False)
    cfg = dataclasses.replace(
        cfg, layer_attention=(LayerAttention(window=8, sinks=True), LayerAttention(sinks=True))
    )
    model = LlamaForCausalLM(cfg, reference_ops(), ReferenceAttention(StepLimits(max_model_len=64)))
    sliding, full = (layer.self_attn for layer in model.layers)
    assert set(sliding.attention_options()) == {"window", "sinks"}
    assert set(full.attention_options()) == {"sinks"}
    assert sliding.attention_options()["sinks"] is sliding.sinks
    assert tuple(sliding.sinks.shape) == (HEADS,)
    layout = LlamaForCausalLM.checkpoint_layout(cfg)
    assert layout.per_layer["self_attn.sinks"] == (HEADS,)
    target = model.weight_placer().target("model.layers.1.self_attn.sinks", (HEADS,))
    assert target.data_ptr() == full.sinks.data_ptr()
    plain = ModelConfig("Llama", 8, 32, 64, 1, HEADS, KV_HEADS, HEAD_DIM, 1e-5, 1e4, 64, False)
    attention = LlamaForCausalLM(plain, reference_ops(), ReferenceAttention()).layers[0].self_attn
    assert attention.attention_options() == {} and attention.sinks is None
