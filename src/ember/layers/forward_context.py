"""Per-step inputs every attention layer reads, passed down explicitly (no global context)."""

from __future__ import annotations

import dataclasses
import functools
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
    # A model whose windowed layers keep their K/V in a pool of their own
    # (`ember.engine.kv_cache_manager`): those layers, and their slot mapping and tables.
    local_layers: frozenset[int] = frozenset()
    local_slot_mapping: torch.Tensor | None = None  # int64 [T]
    local_block_tables: torch.Tensor | None = None  # int32 [S, M]

    def for_layer(self, layer: int) -> ForwardContext:
        """The context decoder layer ``layer`` attends with: its pool's slots and tables."""
        return self._local_view if layer in self.local_layers else self

    @functools.cached_property
    def _local_view(self) -> ForwardContext:
        return dataclasses.replace(
            self,
            slot_mapping=self.local_slot_mapping,
            block_tables=self.local_block_tables,
            local_layers=frozenset(),
        )


def step_context(
    attention: Any,
    arrays: Any,
    num_tokens: int,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    staged: Any,
    local_layers: frozenset[int] = frozenset(),
) -> ForwardContext:
    """The context of a step staged into ``arrays`` (an input block's device tensors by name),
    with ``attention``'s metadata (an `AttentionBackend`, over what it ``staged``), and the
    local layers' slots and tables where the block has them."""
    return ForwardContext(
        positions=arrays["positions"][:num_tokens],
        slot_mapping=arrays["slot_mapping"][:num_tokens],
        query_start_loc=arrays["query_start_loc"][: num_seqs + 1],
        seq_lens=arrays["seq_lens"][:num_seqs],
        block_tables=arrays["block_tables"][:num_seqs],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        attention=attention.metadata(arrays, staged, num_seqs, max_query_len, max_seq_len),
        **local_context(arrays, local_layers, num_tokens, num_seqs),
    )


def local_context(
    arrays: Any, local_layers: frozenset[int], num_tokens: int, num_seqs: int
) -> dict[str, Any]:
    """`ForwardContext`'s local fields over ``arrays`` (none without local layers)."""
    if not local_layers:
        return {}
    return {
        "local_layers": local_layers,
        "local_slot_mapping": arrays["local_slot_mapping"][:num_tokens],
        "local_block_tables": arrays["local_block_tables"][:num_seqs],
    }
