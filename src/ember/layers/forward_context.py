"""Per-step inputs every attention layer reads, passed down explicitly (no global context)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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
    # The attention backend's own metadata of the step (`AttentionBackend.metadata`); None:
    # the backend plans from the fields above.
    attention: Any = None
