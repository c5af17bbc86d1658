"""One CUDA graph per decode batch-size bucket, captured the first time a bucket is needed.

All graphs of a model instance share one memory pool. A graph replays the forward pass and the
logits projection against the persistent input buffers; padded rows feed a 1-token sequence whose
KV write goes nowhere (slot -1) and whose output is ignored.
"""

from __future__ import annotations

import logging

import torch

from ember.layers.forward_context import ForwardContext
from ember.runner.input_buffers import InputBuffers

logger = logging.getLogger(__name__)


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: small powers of two, then every multiple of 16."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        buffers: InputBuffers,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        max_batch: int,
        max_seq_len: int,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.kv_cache = kv_cache
        self.cos_sin_cache = cos_sin_cache
        self.max_seq_len = max_seq_len
        self.buckets = decode_buckets(max_batch)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def bucket_for(self, batch: int) -> int | None:
        for size in self.buckets:
            if size >= batch:
                return size
        return None

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the bucket's graph (capturing it first if needed); returns its logits buffer."""
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits

    def _context(self, b: int) -> ForwardContext:
        buf = self.buffers
        return ForwardContext(
            positions=buf["positions"][:b],
            slot_mapping=buf["slot_mapping"][:b],
            query_start_loc=buf["query_start_loc"][: b + 1],
            seq_lens=buf["seq_lens"][:b],
            block_tables=buf["block_tables"][:b],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(
            self.buffers["input_ids"][:b], self._context(b), self.cos_sin_cache, self.kv_cache
        )
        return self.model.compute_logits(hidden)

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The buffers already hold this step's (padded) inputs, so warm-up and capture see
        # valid indices; the warm-up rewrites the same K/V the replay will write.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(b)
        if self._pool is None:
            self._pool = graph.pool()
        logger.info("captured a decode CUDA graph for batch %d", b)
        return graph, logits
