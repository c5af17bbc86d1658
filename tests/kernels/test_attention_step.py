"""A layer's attention step (RoPE, cache write, attention) on the kernels vs the reference, for
decode-only steps (fused into the attention kernel, or not) and mixed steps."""

from __future__ import annotations

import pytest
import torch
from helpers.attention_steps import copy_step, random_step, split_qkv, step_context

from ember.config import StepLimits
from ember.layers.attention import ReferenceAttention, select_attention
from ember.layers.ops import triton_ops
from ember.layers.row_norm import RowNorm

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 64, 16


def _step(gen, q_lens, seq_lens):
    """Inputs of one step over a shuffled cache: q/k/v as views of one fused buffer."""
    return random_step(gen, q_lens, seq_lens, HEADS, KV_HEADS, HEAD_DIM, PAGE)


def _triton(device, fuse_decode=True):
    """The Triton attention backend of this shape (the kernels under the CPU interpreter)."""
    return select_attention(
        triton_ops(),
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        torch.float32,
        device,
        StepLimits(max_num_seqs=8),
        fuse_decode=fuse_decode,
    )


def _run(backend, step, device, deferred_norm=False, inputs=None, **kwargs):
    s = copy_step(step, device)
    if deferred_norm:  # q/k/v as products of un-normalised rows: 1/rms applied in the kernels
        kwargs["row_norm"] = RowNorm(s["parts"], 512, 1e-5)
    q, k, v = split_qkv(s["qkv"], HEADS, KV_HEADS, HEAD_DIM)
    ctx = step_context(s)
    out = torch.full_like(q, float("nan"))
    backend.forward(
        q, k, v, ctx, s["cos_sin"], s["k_cache"], s["v_cache"], HEAD_DIM**-0.5, out, **kwargs
    )
    if inputs is not None:
        inputs.update(q=q.cpu(), k=k.cpu())
    return out.cpu(), s["k_cache"].cpu(), s["v_cache"].cpu()


@pytest.mark.parametrize("deferred_norm", [False, True])
@pytest.mark.parametrize("fuse_decode", [True, False])
@pytest.mark.parametrize(
    ("q_lens", "seq_lens"), [([1, 1, 1, 1], [200, 9, 64, 33]), ([5, 1, 12], [5, 70, 40])]
)
def test_matches_reference(gen, device, fuse_decode, q_lens, seq_lens, deferred_norm):
    step = _step(gen, q_lens, seq_lens)
    # Sums of squares of rows 512 wide, mean square 4-64, over 3 parts: 1/rms of 0.125-0.5.
    step["parts"] = 512 * (4 + 60 * torch.rand(sum(q_lens), 3, generator=gen)) / 3
    expected = _run(ReferenceAttention(), step, "cpu", deferred_norm)
    got = _run(_triton(device, fuse_decode), step, device, deferred_norm)
    for actual, wanted in zip(got, expected):
        torch.testing.assert_close(actual, wanted, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("fuse_decode", [True, False])
def test_a_fused_decode_leaves_q_and_k_unrotated(gen, device, fuse_decode):
    """The switch reaches the kernels: fused into the attention kernel, a decode rotates q and k
    in registers only; apart, the RoPE kernel rotates them in place first."""
    step = _step(gen, [1, 1], [20, 9])
    seen = {}
    _run(_triton(device, fuse_decode), step, device, inputs=seen)
    q, k, _ = step["qkv"].split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    unchanged = torch.equal(seen["q"].reshape(q.shape), q) and torch.equal(
        seen["k"].reshape(k.shape), k
    )
    assert unchanged == fuse_decode
