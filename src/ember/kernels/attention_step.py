"""One layer's attention for a step: RoPE, the KV-cache write and paged attention.

Decode-only steps do all three in the attention kernel (a launch less per layer); steps with
prefill chunks rotate and write with `rope_and_cache_write` first, since their queries span
many tokens per program.
"""

from __future__ import annotations

import torch

from ember.kernels.paged_attention import DecodeRope, paged_attention
from ember.kernels.rope_cache_write import rope_and_cache_write


def rope_and_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    split_counters: torch.Tensor | None = None,
    fuse_decode: bool = True,
    pdl: bool = False,
) -> torch.Tensor:
    """`rope_and_cache_write` then `paged_attention` (same arguments); writes and returns
    ``out``. With ``fuse_decode`` (the default), decode-only steps do both in the attention
    kernel and leave ``q`` and ``k`` unrotated (only the cache and ``out`` are written)."""
    attention = {
        "max_query_len": max_query_len,
        "max_seq_len": max_seq_len,
        "split_counters": split_counters,
        "pdl": pdl,
    }
    if fuse_decode and max_query_len == 1:
        rope = DecodeRope(k, v, positions, cos_sin_cache, slot_mapping)
        return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                               scale, out, rope=rope, **attention)  # fmt: skip
    rope_and_cache_write(q, k, v, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, pdl=pdl)
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                           out, **attention)  # fmt: skip
