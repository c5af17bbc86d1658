"""Per-step inputs every attention layer reads, passed down explicitly (no global context)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ember.kernels.attention_plan import ChunkTiles


@dataclass
class ForwardContext:
    """Attention metadata of one step; the layout is in docs/CONTRACTS.md."""

    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]
    block_tables: torch.Tensor  # int32 [S, M]
    max_query_len: int
    max_seq_len: int
    # Persistent int32 zeros (>= sequences x KV heads): split-KV attention's arrival counters
    # (the kernel re-zeroes them); None: zeros allocated per call.
    split_kv_counters: torch.Tensor | None = None
    # A mixed step's map of its chunks' query tiles for the attention kernel; None: the kernel
    # finds each tile's sequence itself.
    chunk_tiles: ChunkTiles | None = None
