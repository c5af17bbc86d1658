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


def step_context(
    attention: Any,
    arrays: Any,
    num_tokens: int,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    staged: Any,
) -> ForwardContext:
    """The context of a step staged into ``arrays`` (an input block's device tensors by name),
    with ``attention``'s metadata (an `AttentionBackend`, over what it ``staged``)."""
    return ForwardContext(
        positions=arrays["positions"][:num_tokens],
        slot_mapping=arrays["slot_mapping"][:num_tokens],
        query_start_loc=arrays["query_start_loc"][: num_seqs + 1],
        seq_lens=arrays["seq_lens"][:num_seqs],
        block_tables=arrays["block_tables"][:num_seqs],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        attention=attention.metadata(arrays, staged, num_seqs, max_query_len, max_seq_len),
    )
