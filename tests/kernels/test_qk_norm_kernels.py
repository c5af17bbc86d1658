"""Qwen3's q/k RMSNorm inside the kernels that rotate q and k (the ``qk_norm`` option,
`ember.layers.qk_norm.QkNorm`), on the Triton kernels interpreted on a CPU: the prefill / mixed
step's RoPE kernel and a decode's attention kernel give, bit for bit, what the RMSNorm kernel
run on q and k first, then the same kernels without the option, give (the same roundings and,
under the interpreter, the same sums), and the reference's values within a rounding.

Against the reference the match is as close as the RMSNorm kernel's own, not exact: torch sums
the squares in another order (about one normalised value in five a last fp32 bit or two apart),
and the interpreter casts fp32 to bf16 by truncating where torch rounds to nearest (most bf16
values one or two steps apart; a GPU rounds as torch).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.attention_steps import copy_step, random_step, split_qkv, step_context

from ember.config import StepLimits
from ember.kernels.compile_ahead import kernels_interpreted
from ember.kernels.paged_attention import DecodeRope, paged_attention
from ember.kernels.rmsnorm import rms_norm
from ember.kernels.rope_cache_write import rope_and_cache_write
from ember.layers.attention import ReferenceAttention, select_attention
from ember.layers.ops import triton_ops
from ember.layers.qk_norm import QkNorm
from ember.layers.reference_ops import (
    quantize_kv_reference,
    rms_norm_reference,
    rope_and_cache_write_reference,
)
from ember.layers.row_norm import RowNorm

pytestmark = pytest.mark.slow

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 64, 16
EPS = 1e-6
# Kernel vs reference: fp32 a few last bits apart; bf16 a step or two (the interpreter's casts).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 6e-2}
DECODES = ([1, 1, 1, 1], [200, 9, 64, 33])
MIXED = ([5, 1, 12, 1], [5, 70, 40, 20])


def _qk_norm(gen, head_dim, dtype) -> QkNorm:
    """Learned-looking weights, none of them 1: q's positive gains, k's of either sign."""
    q_weight = 0.25 + 1.5 * torch.rand(head_dim, generator=gen)
    k_weight = torch.randn(head_dim, generator=gen)
    return QkNorm(q_weight.to(dtype), k_weight.to(dtype), EPS)


def _on(norm: QkNorm, device) -> QkNorm:
    return QkNorm(norm.q_weight.to(device), norm.k_weight.to(device), norm.eps)


def _step(gen, q_lens, seq_lens, dtype, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    """A step's inputs (`random_step`) in ``dtype``, q/k/v away from unit scale so the norm
    has something to do."""
    step = random_step(gen, q_lens, seq_lens, heads, kv_heads, head_dim, PAGE)
    step["qkv"] = step["qkv"] * 3.0 + 0.5
    for name in ("qkv", "k_cache", "v_cache"):
        step[name] = step[name].to(dtype)
    return step


def _separately_normed(q, k, qk_norm):
    """q and k through the RMSNorm kernel, as a Qwen3 layer ran them before the fusion."""
    return rms_norm(q, qk_norm.q_weight, qk_norm.eps), rms_norm(k, qk_norm.k_weight, qk_norm.eps)


def _assert_same(got, wanted):
    """Bit for bit under the interpreter (every operation rounded alike)."""
    if kernels_interpreted():
        assert torch.equal(got, wanted), f"{int((got != wanted).sum())} values differ"
    else:  # compiled reductions may sum in another order, and FMAs round once
        torch.testing.assert_close(got.float(), wanted.float(), atol=2e-2, rtol=2e-2)


def _assert_near_reference(got, wanted, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), wanted.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("use_rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [(8, 2, 64, torch.float32), (16, 4, 128, torch.bfloat16), (6, 1, 64, torch.bfloat16)],
)
def test_the_rope_kernel_norms_q_and_k_as_the_rms_norm_kernel(
    gen, device, heads, kv_heads, head_dim, dtype, use_rope
):
    """`rope_and_cache_write` with ``qk_norm`` (a prefill or mixed step; the last token is
    padding): q and k rotated in place and both caches as after the separate norm; the
    reference's within a rounding."""
    step = _step(gen, [5, 4], [9, 30], dtype, heads, kv_heads, head_dim)
    norm = _qk_norm(gen, head_dim, dtype)

    def run(write, s, norm_first=None, **options):
        q, k, v = split_qkv(s["qkv"], heads, kv_heads, head_dim)
        if norm_first is not None:
            q, k = _separately_normed(q, k, norm_first)
        meta = (s["positions"], s["cos_sin"], s["slots"], s["k_cache"], s["v_cache"])
        write(q, k, v, *meta, use_rope=use_rope, **options)
        return q.cpu(), k.cpu(), s["k_cache"].cpu(), s["v_cache"].cpu()

    fused = run(rope_and_cache_write, copy_step(step, device), qk_norm=_on(norm, device))
    separate = run(rope_and_cache_write, copy_step(step, device), norm_first=_on(norm, device))
    for got, wanted in zip(fused, separate):
        _assert_same(got, wanted)
    expected = run(rope_and_cache_write_reference, copy_step(step), qk_norm=norm)
    for got, wanted in zip(fused, expected):
        _assert_near_reference(got, wanted, dtype)


def _triton(device, dtype, fuse_decode=True, kv_dtype=None):
    return select_attention(
        triton_ops(),
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        dtype,
        device,
        StepLimits(max_num_seqs=8),
        fuse_decode=fuse_decode,
        kv_dtype=kv_dtype,
    )


def _layer_step(backend, step, device, norm_first=None, **options):
    """One layer's attention step through ``backend``: its output and both caches, on the CPU.
    ``norm_first``: q and k through the RMSNorm kernel before (a layer before the fusion)."""
    s = copy_step(step, device)
    q, k, v = split_qkv(s["qkv"], HEADS, KV_HEADS, HEAD_DIM)
    if norm_first is not None:
        q, k = _separately_normed(q, k, norm_first)
    out = torch.full_like(q, float("nan"))
    cache_args = (s["cos_sin"], s["k_cache"], s["v_cache"])
    backend.forward(q, k, v, step_context(s), *cache_args, HEAD_DIM**-0.5, out, **options)
    return out.cpu(), s["k_cache"].cpu(), s["v_cache"].cpu()


STEPS = [(True, *DECODES), (False, *DECODES), (True, *MIXED)]
STEP_IDS = ["fused-decode", "decode", "mixed"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fuse_decode", "q_lens", "seq_lens"), STEPS, ids=STEP_IDS)
def test_a_layer_step_norms_q_and_k_as_the_rms_norm_kernel(
    gen, device, dtype, fuse_decode, q_lens, seq_lens
):
    """The Triton backend with ``qk_norm``: a decode normalises q and k in the attention kernel
    (fused) or in the RoPE kernel, a mixed step in the RoPE kernel; the output and the caches
    are those of the separate norm, and the reference's within a rounding."""
    step = _step(gen, q_lens, seq_lens, dtype)
    norm = _qk_norm(gen, HEAD_DIM, dtype)
    backend = _triton(device, dtype, fuse_decode)
    fused = _layer_step(backend, step, device, qk_norm=_on(norm, device))
    separate = _layer_step(backend, step, device, norm_first=_on(norm, device))
    for got, wanted in zip(fused, separate):
        _assert_same(got, wanted)
    expected = _layer_step(ReferenceAttention(), step, "cpu", qk_norm=norm)
    attention_tolerance = {torch.float32: 2e-4, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(
        fused[0].float(), expected[0].float(), atol=attention_tolerance, rtol=attention_tolerance
    )
    for got, wanted in zip(fused[1:], expected[1:]):
        _assert_near_reference(got, wanted, dtype)


@pytest.mark.parametrize(("splits", "preload_kv"), [(1, True), (3, False), (3, True)])
def test_a_decode_in_the_attention_kernel_norms_its_new_key_once(gen, device, splits, preload_kv):
    """Split or not, with the K/V preload or not (the tile holding the new key takes it from
    registers): the fused decode's output and caches are the separate norm's, in bf16."""
    dtype = torch.bfloat16
    step = _step(gen, *DECODES, dtype)
    norm = _on(_qk_norm(gen, HEAD_DIM, dtype), device)
    planner = _triton(device, dtype).planner
    (launch,) = planner.plan(len(DECODES[0]), 1, max(DECODES[1]), splits=splits)
    launch = dataclasses.replace(launch, preload_kv=preload_kv)

    def run(qk_norm=None, norm_first=None):
        s = copy_step(step, device)
        q, k, v = split_qkv(s["qkv"], HEADS, KV_HEADS, HEAD_DIM)
        if norm_first is not None:
            q, k = _separately_normed(q, k, norm_first)
        rope = DecodeRope(k, v, s["positions"], s["cos_sin"], s["slots"], qk_norm=qk_norm)
        meta = (s["query_start_loc"], s["seq_lens"], s["block_tables"])
        out = torch.full_like(q, float("nan"))
        caches = s["k_cache"], s["v_cache"]
        paged_attention(q, *caches, *meta, HEAD_DIM**-0.5, out, (launch,), rope=rope)
        return out.cpu(), *(cache.cpu() for cache in caches)

    for got, wanted in zip(run(qk_norm=norm), run(norm_first=norm)):
        _assert_same(got, wanted)


FP8_SCALES = (0.37, 1.9)
COMBINATIONS = {
    "deferred-norm": {"row_norm": True},
    "fp8-cache": {"kv_scales": FP8_SCALES},
    "window-sinks": {"window": 20, "sinks": True},
    "nope": {"use_rope": False},
}


@pytest.mark.parametrize("combination", list(COMBINATIONS))
@pytest.mark.parametrize(("fuse_decode", "q_lens", "seq_lens"), STEPS, ids=STEP_IDS)
def test_qk_norm_with_the_other_options_matches_the_reference(
    gen, device, combination, fuse_decode, q_lens, seq_lens
):
    """``qk_norm`` beside a deferred RMSNorm (the row's 1/rms scales q and k first, then they
    are normalised: never in a model, Qwen3 does not defer its norms, but well defined), an FP8
    cache (the normalised, rotated key quantized), a window with sinks, a NoPE layer."""
    fp8 = combination == "fp8-cache"
    step = _step(gen, q_lens, seq_lens, torch.float32)
    if fp8:  # earlier steps' entries as an FP8 cache holds them
        for name in ("k_cache", "v_cache"):
            step[name] = quantize_kv_reference(step[name], FP8_SCALES[0])
    norm = _qk_norm(gen, HEAD_DIM, torch.float32)
    options = dict(COMBINATIONS[combination])
    tokens = sum(q_lens)
    parts = 512 * (4 + 60 * torch.rand(tokens, 3, generator=gen)) / 3
    sinks = torch.randn(HEADS, generator=gen) * 2

    def on(where):
        placed = dict(options, qk_norm=_on(norm, where))
        if placed.pop("row_norm", False):
            placed["row_norm"] = RowNorm(parts.to(where), 512, 1e-5)
        if placed.pop("sinks", False):
            placed["sinks"] = sinks.to(where)
        return placed

    kv_dtype = torch.float8_e4m3fn if fp8 else None
    got = _layer_step(
        _triton(device, torch.float32, fuse_decode, kv_dtype), step, device, **on(device)
    )
    expected = _layer_step(ReferenceAttention(), step, "cpu", **on("cpu"))
    assert not got[0].isnan().any(), "rows left unwritten"
    torch.testing.assert_close(got[0], expected[0], atol=2e-4, rtol=2e-4)
    for got_cache, wanted in zip(got[1:], expected[1:]):
        # An FP8 entry may sit one e4m3 step apart, where the fp32 sums round the other way.
        tol = 2**-3 if fp8 else TOLERANCE[torch.float32]
        torch.testing.assert_close(got_cache.float(), wanted.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_option_is_the_separate_rms_norm(gen, dtype):
    """The CPU path's ``qk_norm`` is its RMSNorm of each head, as a layer ran it: exactly."""
    step = _step(gen, [5, 4], [9, 30], dtype)
    norm = _qk_norm(gen, HEAD_DIM, dtype)
    results = []
    for fused in (True, False):
        s = copy_step(step)
        q, k, v = split_qkv(s["qkv"], HEADS, KV_HEADS, HEAD_DIM)
        if not fused:
            q = rms_norm_reference(q.reshape(-1, HEAD_DIM), norm.q_weight, EPS).view_as(q)
            k = rms_norm_reference(k.reshape(-1, HEAD_DIM), norm.k_weight, EPS).view_as(k)
        meta = (s["positions"], s["cos_sin"], s["slots"], s["k_cache"], s["v_cache"])
        rope_and_cache_write_reference(q, k, v, *meta, qk_norm=norm if fused else None)
        results.append((q, k, s["k_cache"]))
    for got, wanted in zip(*results):
        assert torch.equal(got, wanted)


def test_both_q_k_norms_at_once_are_refused(gen, device):
    step = _step(gen, [1, 1], [5, 9], torch.float32)
    norm = _qk_norm(gen, HEAD_DIM, torch.float32)
    both = {"qk_norm": norm, "qk_l2_norm_eps": 1e-5}
    for backend, fuse_decode in ((ReferenceAttention(), None), (None, True), (None, False)):
        backend = backend or _triton(device, torch.float32, fuse_decode)
        where = "cpu" if isinstance(backend, ReferenceAttention) else device
        placed = dict(both, qk_norm=_on(norm, where))
        with pytest.raises(ValueError, match="not supported together"):
            _layer_step(backend, step, where, **placed)
    wrong = QkNorm(norm.q_weight[:-1].to(device), norm.k_weight.to(device), EPS)
    with pytest.raises(ValueError, match=r"qk_norm's q_weight must be contiguous \[64\]"):
        _layer_step(_triton(device, torch.float32), step, device, qk_norm=wrong)
