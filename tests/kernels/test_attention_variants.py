"""Windows, chunks, sinks, NoPE layers and QK L2 norm on the Triton kernels (interpreted on a
CPU) against the reference (docs/CONTRACTS.md, "Windows, sinks, chunks"): layer steps (decodes
fused into the attention kernel or not, split-KV or not; mixed steps of chunks and decodes) with
windows shorter than, as long as and longer than the contexts, and split decodes whose
segments are cut from the window alone. Keys before a window are never read: the cache there
holds NaN, which any read would spread to the output."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.attention_steps import copy_step, random_step, split_qkv, step_context
from helpers.hf_reference import hf_greedy_tokens
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.config import StepLimits
from ember.kernels.attention_plan import AttentionPlanner, AttentionTuning
from ember.kernels.paged_attention import DecodeRope, paged_attention
from ember.layers.attention import ReferenceAttention, select_attention
from ember.layers.ops import triton_ops
from ember.layers.reference_ops import first_visible_key, quantize_kv_reference

pytestmark = pytest.mark.slow

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 32, 16
# Every tile a kernel reads starts at or after a multiple of this below the first visible key.
LARGEST_TILE = 128


def _sinks(gen):
    return torch.randn(HEADS, generator=gen) * 2


def _triton(device, fuse_decode=True, kv_dtype=None):
    return select_attention(
        triton_ops(),
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        torch.float32,
        device,
        StepLimits(max_num_seqs=8),
        fuse_decode=fuse_decode,
        kv_dtype=kv_dtype,
    )


def _poison_before_window(step, options):
    """A copy of ``step`` whose cache holds NaN at every position below the tiles any of its
    queries' keys start in, through each sequence's table."""
    poisoned = copy_step(step)
    starts = step["query_start_loc"].tolist()
    for seq, seq_len in enumerate(step["seq_lens"].tolist()):
        q_len = starts[seq + 1] - starts[seq]
        local = {k: options.get(k) for k in ("window", "chunk_size")}
        first = int(first_visible_key(torch.tensor(seq_len - q_len), **local))
        for pos in range(first // LARGEST_TILE * LARGEST_TILE):
            block = int(step["block_tables"][seq, pos // PAGE])
            for cache in ("k_cache", "v_cache"):
                poisoned[cache][block, pos % PAGE] = float("nan")
    return poisoned


def _run(backend, step, device, **options):
    """One layer's step through ``backend``: its output and both caches, on the CPU."""
    s = copy_step(step, device)
    q, k, v = split_qkv(s["qkv"], HEADS, KV_HEADS, HEAD_DIM)
    out = torch.full_like(q, float("nan"))
    backend.forward(
        q,
        k,
        v,
        step_context(s),
        s["cos_sin"],
        s["k_cache"],
        s["v_cache"],
        HEAD_DIM**-0.5,
        out,
        **{k: v.to(device) if torch.is_tensor(v) else v for k, v in options.items()},
    )
    return out.cpu(), s["k_cache"].cpu(), s["v_cache"].cpu()


def _assert_matches_reference(step, device, fuse_decode=True, **options):
    expected = _run(ReferenceAttention(), step, "cpu", **options)
    got = _run(
        _triton(device, fuse_decode), _poison_before_window(step, options), device, **options
    )
    assert not got[0].isnan().any(), "a kernel read keys before the window"
    torch.testing.assert_close(got[0], expected[0], atol=2e-4, rtol=2e-4)
    written = step["slots"] >= 0  # the caches as the reference wrote them where the step wrote
    for got_cache, wanted in zip(got[1:], expected[1:]):
        slots = step["slots"][written]
        flat = (c.view(-1, KV_HEADS, HEAD_DIM)[slots] for c in (got_cache, wanted))
        torch.testing.assert_close(*flat, atol=2e-5, rtol=2e-5)
    return expected[0]


DECODES = ([1, 1, 1, 1], [300, 9, 33, 70])  # the H200 table splits these in 64-key segments
MIXED = ([5, 1, 40, 1], [5, 70, 100, 260])  # a chunk over several tiles, a long decode


@pytest.mark.parametrize("fuse_decode", [True, False])
@pytest.mark.parametrize("window", [1, 33, 500])  # shorter, as long as one, longer than all
def test_decode_windows(gen, device, fuse_decode, window):
    step = random_step(gen, *DECODES, HEADS, KV_HEADS, HEAD_DIM, PAGE)
    windowed = _assert_matches_reference(step, device, fuse_decode, window=window)
    plain = _run(ReferenceAttention(), step, "cpu")[0]
    # 500 hides nothing; 33 hides keys of all but the 9- and 33-token sequences.
    assert torch.equal(windowed, plain) == (window == 500)


@pytest.mark.parametrize(
    "options",
    [
        {"window": 20, "sinks": True},
        {"chunk_size": 48},
        {"chunk_size": 32, "use_rope": False, "qk_l2_norm_eps": 1e-5},
        {"sinks": True, "use_rope": False},
    ],
    ids=["window-sinks", "chunks", "chunks-nope-l2", "sinks-nope"],
)
@pytest.mark.parametrize(("q_lens", "seq_lens"), [DECODES, MIXED], ids=["decode", "mixed"])
def test_layer_steps(gen, device, options, q_lens, seq_lens):
    step = random_step(gen, q_lens, seq_lens, HEADS, KV_HEADS, HEAD_DIM, PAGE)
    if options.get("sinks"):
        options = dict(options, sinks=_sinks(gen))
    _assert_matches_reference(step, device, **options)


@pytest.mark.parametrize("options", [{"window": 8}, {"chunk_size": 64}])
def test_chunk_rows_whose_keys_start_past_a_tile(gen, device, options):
    """A chunk at positions 250-289: its first query tile starts reading in the 128-key tile
    below 256, where its later rows (their window, or their chunk, starting at 256) see no key.
    Their sums must stay zero there, not exp2(-inf + inf)."""
    step = random_step(gen, [40, 1], [290, 20], HEADS, KV_HEADS, HEAD_DIM, PAGE)
    _assert_matches_reference(step, device, **options)


def test_unfused_decode_with_qk_l2_norm_and_sinks(gen, device):
    step = random_step(gen, *DECODES, HEADS, KV_HEADS, HEAD_DIM, PAGE)
    options = {"qk_l2_norm_eps": 1e-5, "sinks": _sinks(gen), "window": 40}
    _assert_matches_reference(step, device, fuse_decode=False, **options)


def _planner():
    return AttentionPlanner(AttentionTuning(), HEADS, KV_HEADS, HEAD_DIM, 4)


@pytest.mark.parametrize("preload_kv", [False, True])
@pytest.mark.parametrize(("splits", "options"), [(5, {"window": 70}), (3, {"chunk_size": 96})])
def test_split_decodes_cut_the_window_alone(gen, device, splits, options, preload_kv):
    """Forced splits over a fused decode with sinks: each sequence's segments cover its window
    (a 70-key window: two 64-key tiles, so at most two of the five segments run), the merge adds
    each sink once, and the arrival counters end at zero. With ``preload_kv`` each segment's
    first tile (the window's first, masked below it) is read before the new key is stored."""
    step = random_step(gen, *DECODES, HEADS, KV_HEADS, HEAD_DIM, PAGE)
    sinks = _sinks(gen)
    expected = _run(ReferenceAttention(), step, "cpu", sinks=sinks, **options)[0]
    on = copy_step(_poison_before_window(step, options), device)
    q, k, v = split_qkv(on["qkv"], HEADS, KV_HEADS, HEAD_DIM)
    (launch,) = _planner().plan(4, 1, 300, splits=splits)
    launch = dataclasses.replace(launch, preload_kv=preload_kv)
    counters = torch.zeros(4 * KV_HEADS, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    rope = DecodeRope(k, v, on["positions"], on["cos_sin"], on["slots"])
    meta = (on["query_start_loc"], on["seq_lens"], on["block_tables"])
    paged_attention(
        q,
        on["k_cache"],
        on["v_cache"],
        *meta,
        HEAD_DIM**-0.5,
        out,
        (launch,),
        split_counters=counters,
        rope=rope,
        sinks=sinks.to(device),
        **options,
    )
    torch.testing.assert_close(out.cpu(), expected, atol=2e-4, rtol=2e-4)
    assert not counters.any()


def test_sinks_in_the_model_dtype_are_read_as_float32(gen, device):
    step = random_step(gen, *MIXED, HEADS, KV_HEADS, HEAD_DIM, PAGE)
    sinks = _sinks(gen).to(torch.bfloat16)
    _assert_matches_reference(step, device, sinks=sinks, window=24)


def test_fp8_cache_with_a_window(gen, device):
    scales = (0.37, 1.9)

    def fp8_cache(shape):
        return quantize_kv_reference(torch.randn(shape, generator=gen), scales[0])

    step = random_step(gen, *MIXED, HEADS, KV_HEADS, HEAD_DIM, PAGE, fp8_cache)
    options = {"window": 30, "kv_scales": scales}
    expected = _run(ReferenceAttention(), step, "cpu", **options)
    got = _run(_triton(device, kv_dtype=torch.float8_e4m3fn), step, device, **options)
    torch.testing.assert_close(got[0], expected[0], atol=2e-4, rtol=2e-4)


def test_the_invalid_are_refused(gen, device):
    step = random_step(gen, [1], [5], HEADS, KV_HEADS, HEAD_DIM, PAGE)
    with pytest.raises(ValueError, match="not both"):
        _run(_triton(device), step, device, window=4, chunk_size=8)
    with pytest.raises(ValueError, match="sinks"):
        _run(_triton(device), step, device, sinks=torch.zeros(HEADS + 1))


def test_a_sliding_window_mistral_on_the_kernels_gives_transformers_tokens(tmp_path, device):
    """The engine on the kernels (chunked prefill through a small token budget, then decodes
    past the 12-key window; blocks of 4, given back as the window passes them, their entries
    the scratch block): transformers' greedy tokens."""
    transformers = pytest.importorskip("transformers")
    path = make_tiny_model("MistralForCausalLM", tmp_path, sliding_window=12)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (5, 29)]
    llm = LLM(
        str(path),
        device=str(device),
        backend="triton",
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=16,
        block_size=4,
        kv_cache_memory_bytes=64 << 20,
    )
    assert llm.instance.kv_manager.window == 12
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, 10)
