"""RoPE on q and k fused with the paged KV-cache write of k and v.

One program per token: it rotates all of the token's query and key heads in place (HF
"rotate_half" / neox style, fp32 math, cast back) and stores the rotated key and the value at the
token's cache slot. Fusing saves a second read of k and a launch per layer. Semantics follow
docs/CONTRACTS.md ("RoPE", "Paged KV cache layout"); ``slot_mapping[t] == -1`` writes nothing.
With a deferred RMSNorm (``row_norm``, `ember.layers.row_norm`) q, k and v are first scaled by
their token's ``1/rms`` and rounded, as the normalised row's q/k/v projection would give them.
Qwen3's q/k norm (``qk_norm``) RMS-normalises each head before the rotation, Llama 4's L2 norm
(``qk_l2_norm_eps``) after it.
An FP8 cache stores k and v quantized by the layer's scales (`ember.kernels.kv_fp8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.compile_ahead import launch
from ember.kernels.head_norm import head_inv_rms, qk_norm_args, rms_norm_heads
from ember.kernels.kv_fp8 import is_fp8_cache, kv_scale_args, to_cache
from ember.kernels.pdl import wait_for_producer
from ember.kernels.row_norm import (
    check_row_norm,
    load_inv_rms,
    row_norm_args,
    scale_and_round,
)
from ember.layers.qk_norm import QkNorm, check_qk_norms
from ember.layers.row_norm import RowNorm


@triton.jit
def _rotate_heads_in_place(
    x_ptr,
    stride_head,
    cos,
    sin,
    scale,
    norm_weight_ptr,
    rms_eps,
    l2_eps,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    SCALED: tl.constexpr,
    ROTATE: tl.constexpr,
    RMS_NORM: tl.constexpr,
    L2_NORM: tl.constexpr,
):
    """Rotate one token's ``[NUM_HEADS, 2 * HALF]`` heads in place (scaled by ``scale`` first
    when ``SCALED``; RMS-normalised with ``norm_weight_ptr``'s weight before the rotation when
    ``RMS_NORM``; not rotated unless ``ROTATE``; each head normalised by its RMS after, no
    weight, when ``L2_NORM``); returns the halves as stored."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    offsets = heads[:, None] * stride_head + dims[None, :]
    mask = (heads < NUM_HEADS)[:, None]
    dtype = x_ptr.dtype.element_ty
    x1 = scale_and_round(tl.load(x_ptr + offsets, mask=mask, other=0.0), scale, dtype, SCALED)
    x2 = scale_and_round(
        tl.load(x_ptr + offsets + HALF, mask=mask, other=0.0), scale, dtype, SCALED
    )
    if RMS_NORM:  # Qwen3's q/k norm, on the heads as loaded (and scaled)
        # The sums of squares over whole heads (reread), as the RMSNorm kernel sums its rows.
        whole = heads[:, None] * stride_head + tl.arange(0, 2 * HALF)[None, :]
        x = scale_and_round(tl.load(x_ptr + whole, mask=mask, other=0.0), scale, dtype, SCALED)
        inv_rms = head_inv_rms(tl.sum(x * x, 1, keep_dims=True), rms_eps, 2 * HALF)
        x1 = rms_norm_heads(x1, inv_rms, norm_weight_ptr, dims, dtype)
        x2 = rms_norm_heads(x2, inv_rms, norm_weight_ptr, dims + HALF, dtype)
    if ROTATE:
        out1 = x1 * cos[None, :] - x2 * sin[None, :]
        out2 = x2 * cos[None, :] + x1 * sin[None, :]
    else:
        out1 = x1.to(tl.float32)
        out2 = x2.to(tl.float32)
    if L2_NORM:  # on the rotated heads as rounded, like transformers' Llama4TextL2Norm
        out1 = out1.to(dtype).to(tl.float32)
        out2 = out2.to(dtype).to(tl.float32)
        mean_square = (tl.sum(out1 * out1, 1) + tl.sum(out2 * out2, 1)) / (2 * HALF)
        inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_square + l2_eps))
        out1 = out1 * inv_rms[:, None]
        out2 = out2 * inv_rms[:, None]
    tl.store(x_ptr + offsets, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x_ptr + offsets + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)
    return out1, out2


@triton.jit
def _rope_cache_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    slot_mapping_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    parts_ptr,
    num_parts,
    hidden,
    eps,
    rms_eps,
    l2_eps,
    k_scale,
    v_scale,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    ROW_NORM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
    KV_FP8: tl.constexpr,
    ROTATE: tl.constexpr,
    RMS_NORM: tl.constexpr,
    L2_NORM: tl.constexpr,
):
    wait_for_producer(PDL)
    tok = tl.program_id(0).to(tl.int64)
    scale = 1.0
    if ROW_NORM:
        scale = load_inv_rms(parts_ptr, tok, num_parts, hidden, eps, BLOCK_P)
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, half)
    if ROTATE:
        pos = tl.load(positions_ptr + tok)
        cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + dims)
        sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + dims)
    else:  # a NoPE layer: nothing to read
        cos = tl.zeros([half], dtype=tl.float32)
        sin = cos

    _rotate_heads_in_place(
        q_ptr + tok * stride_q_tok,
        stride_q_head,
        cos,
        sin,
        scale,
        q_norm_ptr,
        rms_eps,
        l2_eps,
        NUM_Q_HEADS,
        BLOCK_HQ,
        half,
        ROW_NORM,
        ROTATE,
        RMS_NORM,
        L2_NORM,
    )
    k1, k2 = _rotate_heads_in_place(
        k_ptr + tok * stride_k_tok,
        stride_k_head,
        cos,
        sin,
        scale,
        k_norm_ptr,
        rms_eps,
        l2_eps,
        NUM_KV_HEADS,
        BLOCK_HKV,
        half,
        ROW_NORM,
        ROTATE,
        RMS_NORM,
        L2_NORM,
    )

    slot = tl.load(slot_mapping_ptr + tok)
    heads = tl.arange(0, BLOCK_HKV)
    # A padded token (slot -1) still gets rotated above; it just is not stored.
    mask = ((heads < NUM_KV_HEADS) & (slot >= 0))[:, None]
    cache_base = (slot // PAGE) * stride_cache_block + (slot % PAGE) * stride_cache_slot
    cache_offsets = cache_base + heads[:, None] * stride_cache_head + dims[None, :]
    cache_ty = k_cache_ptr.dtype.element_ty
    k_ty = k_ptr.dtype.element_ty
    k1 = to_cache(k1, k_scale, k_ty, cache_ty, KV_FP8)
    k2 = to_cache(k2, k_scale, k_ty, cache_ty, KV_FP8)
    tl.store(k_cache_ptr + cache_offsets, k1, mask=mask)
    tl.store(k_cache_ptr + cache_offsets + half, k2, mask=mask)

    v_offsets = tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    v_ty = v_ptr.dtype.element_ty
    v1 = scale_and_round(tl.load(v_ptr + v_offsets, mask=mask, other=0.0), scale, v_ty, ROW_NORM)
    v2 = scale_and_round(
        tl.load(v_ptr + v_offsets + half, mask=mask, other=0.0), scale, v_ty, ROW_NORM
    )
    v1 = to_cache(v1, v_scale, v_ty, cache_ty, KV_FP8)
    v2 = to_cache(v2, v_scale, v_ty, cache_ty, KV_FP8)
    tl.store(v_cache_ptr + cache_offsets, v1, mask=mask)
    tl.store(v_cache_ptr + cache_offsets + half, v2, mask=mask)


def rope_and_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    row_norm: RowNorm | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    pdl: bool = False,
    use_rope: bool = True,
    qk_norm: QkNorm | None = None,
    qk_l2_norm_eps: float | None = None,
) -> None:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place and write k, v to the cache
    (``row_norm``: each token's q, k and v scaled by its ``1/rms`` first; ``v`` itself is left
    unscaled, only its cache copy is). An FP8 cache (float8 e4m3) stores them quantized by
    ``kv_scales`` (k_scale, v_scale), which a cache of any other dtype ignores. ``use_rope``
    False (a NoPE layer) leaves them unrotated; ``qk_norm`` RMS-normalises each head of q and k
    with its weights before the rotation (Qwen3's, rounded as `rms_norm`), ``qk_l2_norm_eps``
    after it (Llama 4's QK norm, `reference_ops.l2_normalize_heads_reference`); not both.

    ``q``, ``k``, ``v`` may be strided views (e.g. of a fused qkv output) with a contiguous last
    dim; ``positions`` and ``slot_mapping`` are int64 ``[T]``; ``cos_sin_cache`` is float32
    ``[P, D]`` from ``reference_ops.build_cos_sin_cache``; caches are
    ``[num_blocks, block_size, Hkv, D]``. ``pdl``: launch with programmatic dependent launch
    (`ember.kernels.pdl`).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"head_dim must be twice a power of two, got {head_dim}")
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must share dtype and layout")
    if min(q.stride(2), k.stride(2), v.stride(2), k_cache.stride(3)) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous float32")
    check_row_norm(row_norm, num_tokens)
    check_qk_norms(qk_norm, qk_l2_norm_eps)
    q_norm, k_norm, rms_eps = qk_norm_args(qk_norm, head_dim, q)
    if num_tokens == 0:
        return
    row_args, block_p = row_norm_args(row_norm, q)
    launch(
        _rope_cache_write_kernel,
        (num_tokens,),
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        slot_mapping,
        k_cache,
        v_cache,
        q_norm,
        k_norm,
        *row_args,
        rms_eps,
        qk_l2_norm_eps or 0.0,
        *kv_scale_args(k_cache, kv_scales),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        ROW_NORM=row_norm is not None,
        BLOCK_P=block_p,
        PDL=pdl,
        KV_FP8=is_fp8_cache(k_cache),
        ROTATE=use_rope,
        RMS_NORM=qk_norm is not None,
        L2_NORM=qk_l2_norm_eps is not None,
        num_warps=4,
        launch_pdl=pdl,
    )
