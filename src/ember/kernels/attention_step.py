"""One layer's attention for a step: RoPE (with Qwen3's q/k norm before it or Llama 4's after
it), the KV-cache write and paged attention.

Decode-only steps do all three in the attention kernel (a launch less per layer); steps with
prefill chunks rotate and write with `rope_and_cache_write` first, since their queries span
many tokens per program.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ember.kernels.attention_plan import AttentionLaunch, ChunkTiles
from ember.kernels.paged_attention import DecodeRope, paged_attention
from ember.kernels.rope_cache_write import rope_and_cache_write
from ember.layers.qk_norm import QkNorm
from ember.layers.row_norm import RowNorm

if TYPE_CHECKING:
    from ember.layers.forward_context import ForwardContext


def rope_and_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: ForwardContext,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    launches: tuple[AttentionLaunch, ...],
    *,
    split_counters: torch.Tensor | None = None,
    chunk_tiles: ChunkTiles | None = None,
    fuse_decode: bool = True,
    row_norm: RowNorm | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    pdl: bool = False,
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    use_rope: bool = True,
    qk_norm: QkNorm | None = None,
    qk_l2_norm_eps: float | None = None,
    fp8_widen_in_registers: bool = False,
) -> torch.Tensor:
    """`rope_and_cache_write` then `paged_attention` (its ``launches``) over the step's metadata
    ``ctx``; writes and returns ``out``. With ``fuse_decode`` (the default), decode-only steps
    do both in the attention kernel and leave ``q`` and ``k`` unrotated (only the cache and
    ``out`` change). ``row_norm``: q, k and v are products of the un-normalised rows, to scale
    by each token's ``1/rms`` first (`ember.layers.row_norm`). ``kv_scales``: an FP8 cache's
    (k_scale, v_scale), for its writes and its reads (`ember.kernels.kv_fp8`). ``use_rope``
    False (a NoPE layer) skips the rotation; ``qk_norm`` RMS-normalises each head of q and k
    before it (Qwen3's), ``qk_l2_norm_eps`` after it (Llama 4's); ``window``, ``chunk_size`` and
    ``sinks`` shape the attention, ``fp8_widen_in_registers`` how an FP8 cache's tiles widen
    (`paged_attention`)."""
    rope = None
    if fuse_decode and ctx.max_query_len == 1:
        rope = DecodeRope(
            k,
            v,
            ctx.positions,
            cos_sin_cache,
            ctx.slot_mapping,
            row_norm,
            rotate=use_rope,
            qk_l2_norm_eps=qk_l2_norm_eps,
            qk_norm=qk_norm,
        )
    else:
        rope_and_cache_write(
            q,
            k,
            v,
            ctx.positions,
            cos_sin_cache,
            ctx.slot_mapping,
            k_cache,
            v_cache,
            row_norm=row_norm,
            kv_scales=kv_scales,
            pdl=pdl,
            use_rope=use_rope,
            qk_norm=qk_norm,
            qk_l2_norm_eps=qk_l2_norm_eps,
        )
    return paged_attention(
        q,
        k_cache,
        v_cache,
        ctx.query_start_loc,
        ctx.seq_lens,
        ctx.block_tables,
        scale,
        out,
        launches,
        split_counters=split_counters,
        rope=rope,
        pdl=pdl,
        chunk_tiles=chunk_tiles,
        kv_scales=kv_scales,
        window=window,
        chunk_size=chunk_size,
        sinks=sinks,
        fp8_widen_in_registers=fp8_widen_in_registers,
    )
