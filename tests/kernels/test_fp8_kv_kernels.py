"""An FP8 KV cache (float8 e4m3, a k_scale and a v_scale per layer) on the Triton kernels,
interpreted on a CPU, against the reference: the prefill-chunk write (`rope_and_cache_write`), a
mixed step, a decode step that writes its new key and value in the attention kernel (with the
K/V preload, split or not), and split-KV decodes. Neither scale is 1 nor a power of two, so a
kernel that forgets one, or divides where it should multiply, is caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.attention_steps import copy_step, random_step, split_qkv, step_context

from ember.config import StepLimits
from ember.kernels.attention_plan import AttentionPlanner, AttentionTuning
from ember.kernels.compile_ahead import kernels_interpreted
from ember.kernels.paged_attention import DecodeRope, paged_attention
from ember.kernels.rope_cache_write import rope_and_cache_write
from ember.layers.attention import select_attention
from ember.layers.ops import triton_ops
from ember.layers.reference_ops import (
    paged_attention_reference,
    quantize_kv_reference,
    rope_and_cache_write_reference,
)

FP8 = torch.float8_e4m3fn
HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 64, 16
KV_SCALES = (0.37, 1.9)
CPU = torch.device("cpu")
# fp32: both sides read the same stored values; the kernel folds the scales into the softmax
# scale and the output where the reference multiplies the values. bf16: as for a bf16 cache.
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


def _step(gen, q_lens, seq_lens, dtype):
    """One step over a shuffled FP8 cache (earlier steps' keys and values as random float8
    entries): q/k/v as views of one fused buffer, the last token padding (slot -1). A few keys
    and values are large enough to clamp at 448 * scale."""

    def fp8_cache(shape):
        return quantize_kv_reference(torch.randn(shape, generator=gen), KV_SCALES[0])

    step = random_step(gen, q_lens, seq_lens, HEADS, KV_HEADS, HEAD_DIM, PAGE, fp8_cache)
    step["qkv"][0, HEADS * HEAD_DIM :] *= 400.0  # the first token's k and v past the FP8 range
    step["qkv"] = step["qkv"].to(dtype)
    return step


def _qkv(s):
    return split_qkv(s["qkv"], HEADS, KV_HEADS, HEAD_DIM)


def _run_layer(backend, step, device, kv_scales=KV_SCALES):
    """One layer's attention step through ``backend``: its output and both caches."""
    s = copy_step(step, device)
    q, k, v = _qkv(s)
    ctx = step_context(s)
    out = torch.full_like(q, float("nan"))
    backend.forward(
        q,
        k,
        v,
        ctx,
        s["cos_sin"],
        s["k_cache"],
        s["v_cache"],
        HEAD_DIM**-0.5,
        out,
        kv_scales=kv_scales,
    )
    return out.cpu(), s["k_cache"].cpu(), s["v_cache"].cpu()


def _triton(device, dtype, fuse_decode):
    return select_attention(
        triton_ops(),
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        dtype,
        device,
        StepLimits(max_num_seqs=8),
        fuse_decode=fuse_decode,
        kv_dtype=FP8,
    )


def _reference(step, read_caches=None):
    """The reference's layer step: its output and the caches it wrote. ``read_caches``: attend
    over these instead (those the kernels wrote), so that a key stored a step apart on a GPU
    (`_assert_cache_matches`) moves neither output."""
    s = copy_step(step)
    q, k, v = _qkv(s)
    caches = s["k_cache"], s["v_cache"]
    rope_and_cache_write_reference(
        q, k, v, s["positions"], s["cos_sin"], s["slots"], *caches, kv_scales=KV_SCALES
    )
    out = paged_attention_reference(
        q,
        *(read_caches or caches),
        s["query_start_loc"],
        s["seq_lens"],
        s["block_tables"],
        HEAD_DIM**-0.5,
        torch.empty_like(q),
        max_query_len=s["max_query_len"],
        max_seq_len=s["max_seq_len"],
        kv_scales=KV_SCALES,
    )
    return out, *caches


def _assert_cache_matches(got: torch.Tensor, wanted: torch.Tensor) -> None:
    """The same float8 bits in every slot (what a later read of either cache sees). On a GPU a
    rare entry may sit one e4m3 step apart: the compiled rotation may fuse multiply-adds and
    round a key's last fp32 bit otherwise (the interpreter rounds each operation as torch)."""
    assert got.dtype == FP8 and wanted.dtype == FP8
    differ = got.view(torch.uint8) != wanted.view(torch.uint8)
    if kernels_interpreted():
        assert not differ.any(), f"{int(differ.sum())} cache entries differ"
        return
    assert differ.float().mean() <= 1e-3
    a, b = got[differ].float(), wanted[differ].float()
    assert ((a - b).abs() <= 2**-3 * torch.maximum(a.abs(), b.abs()) + 2**-9).all()


def _assert_close(got, wanted, dtype):
    assert not got.isnan().any(), "rows left unwritten"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), wanted.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefill_write_stores_what_the_reference_stores(gen, device, dtype):
    """`rope_and_cache_write` (a step with prefill chunks) quantizes the rotated key, rounded
    to the model's dtype first, and the value, each by its own scale, clamped at 448."""
    step = _step(gen, [5, 12], [9, 40], dtype)
    _, *wanted = _reference(step)
    got = copy_step(step, device)
    rope_and_cache_write(
        *_qkv(got),
        got["positions"],
        got["cos_sin"],
        got["slots"],
        got["k_cache"],
        got["v_cache"],
        kv_scales=KV_SCALES,
    )
    _assert_cache_matches(got["k_cache"].cpu(), wanted[0])
    _assert_cache_matches(got["v_cache"].cpu(), wanted[1])
    assert got["k_cache"].cpu().float().abs().max() == 448.0  # the large token clamped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fuse_decode", [True, False])
@pytest.mark.parametrize(
    ("q_lens", "seq_lens"),
    [([5, 1, 12], [5, 70, 40]), ([1, 1, 1, 1], [200, 9, 64, 33])],
    ids=["mixed", "decode"],
)
def test_a_layer_step_matches_the_reference(gen, device, q_lens, seq_lens, fuse_decode, dtype):
    """A mixed step (the RoPE kernel writes, two attention launches read) and a decode step
    (written in the attention kernel when fused, whose tile holding the new key must see it as
    stored): the same cache bytes as the reference, and its output over them."""
    step = _step(gen, q_lens, seq_lens, dtype)
    got_out, *got_caches = _run_layer(_triton(device, dtype, fuse_decode), step, device)
    wanted_out, *wanted_caches = _reference(step, read_caches=got_caches)
    _assert_close(got_out, wanted_out, dtype)
    for got, wanted in zip(got_caches, wanted_caches):
        _assert_cache_matches(got, wanted)


def _planner(step_q: torch.Tensor, num_sms: int = 132) -> AttentionPlanner:
    return AttentionPlanner(
        AttentionTuning(num_sms=num_sms),
        step_q.shape[1],
        KV_HEADS,
        HEAD_DIM,
        1,
        query_elem_bytes=step_q.element_size(),
    )


@pytest.mark.parametrize("preload_kv", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
# The second set puts each new key at a tile's last or first row (32- and 64-key tiles).
@pytest.mark.parametrize("seq_lens", [[300, 7, 65, 1], [64, 32, 65, 33]])
def test_a_decode_writing_in_the_kernel_reads_its_new_key_as_stored(
    gen, device, preload_kv, num_splits, seq_lens
):
    """With ``preload_kv`` a segment's first tile is loaded before the new key is stored, and
    takes the key's row from the values the kernel stored: they must be the quantized ones, or
    that tile would see keys a later step reads otherwise."""
    step = _step(gen, [1] * 4, seq_lens, torch.float32)
    on = copy_step(step, device)
    q_dev, k_dev, v_dev = _qkv(on)
    rope = DecodeRope(k_dev, v_dev, on["positions"], on["cos_sin"], on["slots"])
    (launch,) = _planner(q_dev).plan(4, 1, max(seq_lens), splits=num_splits)
    launch = dataclasses.replace(launch, preload_kv=preload_kv)
    out = torch.full_like(q_dev, float("nan"))
    paged_attention(
        q_dev,
        on["k_cache"],
        on["v_cache"],
        on["query_start_loc"],
        on["seq_lens"],
        on["block_tables"],
        HEAD_DIM**-0.5,
        out,
        (launch,),
        rope=rope,
        kv_scales=KV_SCALES,
    )
    got_caches = on["k_cache"].cpu(), on["v_cache"].cpu()
    wanted_out, *wanted_caches = _reference(step, read_caches=got_caches)
    _assert_close(out.cpu(), wanted_out, torch.float32)
    for got, wanted in zip(got_caches, wanted_caches):
        _assert_cache_matches(got, wanted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_decodes_read_the_fp8_cache(gen, device, dtype, num_splits):
    """Each segment's partial output is scaled by v_scale before the merge."""
    step = _step(gen, [1] * 3, [300, 41, 129], dtype)
    q = torch.randn(3, HEADS, HEAD_DIM, generator=gen).to(dtype)
    meta = (step["query_start_loc"], step["seq_lens"], step["block_tables"])
    scale = HEAD_DIM**-0.5
    wanted = paged_attention_reference(
        q,
        step["k_cache"],
        step["v_cache"],
        *meta,
        scale,
        torch.empty_like(q),
        max_query_len=1,
        max_seq_len=300,
        kv_scales=KV_SCALES,
    )
    launches = _planner(q).plan(3, 1, 300, splits=num_splits)
    assert launches[0].splits == num_splits
    out = torch.full_like(q, float("nan")).to(device)
    caches = step["k_cache"].to(device), step["v_cache"].to(device)
    args = (*caches, *(t.to(device) for t in meta), scale, out, launches)
    paged_attention(q.to(device), *args, kv_scales=KV_SCALES)
    _assert_close(out.cpu(), wanted, dtype)


def test_a_cache_of_the_model_dtype_ignores_the_scales(gen, device):
    """The same kernels over a float32 cache: scales given or not, the same bits."""
    step = _step(gen, [5, 1, 12], [5, 70, 40], torch.float32)
    for name in ("k_cache", "v_cache"):
        step[name] = step[name].float()
    backend = select_attention(
        triton_ops(), HEADS, KV_HEADS, HEAD_DIM, torch.float32, device, StepLimits(max_num_seqs=8)
    )
    scaled = _run_layer(backend, step, device)
    plain = _run_layer(backend, step, device, kv_scales=(1.0, 1.0))
    for got, wanted in zip(scaled, plain):
        assert torch.equal(got, wanted)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_planner_sizes_kv_tiles_by_the_cache_and_the_query_tile_by_the_model(head_dim):
    """`select_attention` gives the planner the cache's element size (1) for the K/V tiles and
    the model's (2, bf16) for the query tile (as sm_90 compiles of FP8 launches stage them:
    `ember.bench.compile_check`), and every launch's tiles fit shared memory."""
    from ember.kernels.attention_plan import shared_memory_estimate

    limits = StepLimits(max_num_seqs=8)
    fp8 = select_attention(
        triton_ops(), 16, 4, head_dim, torch.bfloat16, CPU, limits, kv_dtype=FP8
    ).planner
    bf16 = select_attention(triton_ops(), 16, 4, head_dim, torch.bfloat16, CPU, limits).planner
    assert (fp8.elem_bytes, fp8.query_elem_bytes) == (1, 2)
    assert (bf16.elem_bytes, bf16.query_elem_bytes) == (2, 2)
    budget = AttentionTuning().shared_memory_budget
    for tiles in (fp8.prefill_tiles, fp8.decode_tiles(), fp8.decode_tiles(split_kv=True)):
        assert shared_memory_estimate(tiles, head_dim, 1, 2) <= budget
    tiles = {"BLOCK_M": 128, "BLOCK_N": 128, "KV_STAGES": 2}
    query = 128 * head_dim * 2
    assert shared_memory_estimate(tiles, head_dim, 1, 2) == 2 * 128 * head_dim * 2 + query
    # Wide heads: bf16's prefill tiles shrink to fit, FP8's (half the bytes) keep the table's.
    if head_dim == 256:
        assert bf16.prefill_tiles["BLOCK_N"] < fp8.prefill_tiles["BLOCK_N"] == 128


def _set_kv_scales(llm, k_scale: float, v_scale: float) -> None:
    """What a checkpoint with calibrated scales sets: each layer's attention floats."""
    for layer in llm.instance.model.layers:
        layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale, v_scale


@pytest.mark.slow
def test_the_engine_on_the_kernels_gives_the_reference_tokens_on_an_fp8_cache(
    tmp_path, device, gen
):
    """A tiny Llama, float32, on an FP8 cache with each layer's scales set (as a checkpoint's
    k_scale and v_scale are): the Triton backend's greedy tokens are the reference backend's,
    through chunked prefills, mixed steps and fused decodes. The scales reach both: other
    scales give other logprobs."""
    from helpers.tiny_models import make_tiny_model

    from ember import LLM, SamplingParams

    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)

    def run(backend: str, scales: tuple[float, float]):
        llm = LLM(
            str(path),
            device=str(device),
            max_model_len=128,
            backend=backend,
            dtype="float32",
            kv_cache_dtype="fp8",
            max_num_batched_tokens=16,  # the longer prompts chunk: chunks start mid-sequence
            kv_cache_memory_bytes=16 << 20,
            lazy_cuda_graphs=True,  # on a GPU: captured after the scales are set, with them
        )
        _set_kv_scales(llm, *scales)
        if backend == "triton":  # its K/V tiles planned by the cache's element size
            assert llm.instance.attention.planner.elem_bytes == 1
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.instance.scheduler.check_invariants()
        return [o.outputs[0] for o in outs]

    reference = run("reference", KV_SCALES)
    triton = run("triton", KV_SCALES)
    assert [o.token_ids for o in triton] == [o.token_ids for o in reference]
    unit = run("reference", (1.0, 1.0))
    assert [o.logprobs[0].logprob for o in unit] != [o.logprobs[0].logprob for o in reference]
