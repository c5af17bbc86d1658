"""CUDA graphs for engine steps, one per shape bucket, captured the first time a bucket is needed.

Two families share one memory pool per model instance:

* decode steps (one query token per sequence), keyed by the padded batch size and a bound on the
  step's longest sequence; a graph replays the forward pass and the logits projection;
* mixed steps (prefill chunks, possibly beside decodes), keyed by the padded token count with
  the sequence count padded to the scheduler's maximum; a graph replays the forward pass and
  gathers the hidden rows to sample, and the logits of the real rows are computed after it.

Padded tokens write no KV (slot -1) and their rows are never read. Padded decode rows are
1-token sequences on scratch block 0; padded mixed-step sequences are empty (no query tokens),
so attention skips them.

A decode graph fixes how attention plans the step (its KV split count), which depends on the
longest sequence the graph may see. Planned for the model's whole length, a step of short
sequences would run surplus split programs or split where it should not. So each batch bucket
has a graph per length class (powers of two from 512 to the model's length) that the attention
backend plans differently (`AttentionBackend.decode_variant`); a step takes the smallest class
that holds its longest sequence (a step A/B at batch 1-64;
bench/results/README.md, "Decode graph length classes").

Without graphs, a step's ~400 small kernel launches cost more CPU time than the GPU spends on
them.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from dataclasses import dataclass

import torch

from ember.config import StepLimits
from ember.kernels.compile_ahead import CompileCounts
from ember.layers.attention import AttentionBackend, StagedAttention
from ember.layers.forward_context import ForwardContext, local_context
from ember.runner.input_buffers import InputBuffers

logger = logging.getLogger(__name__)

# Mixed steps up to this many tokens are padded to a power of two (their GEMMs are bound by the
# weights' bytes, so the padding rows cost little); above, to one of _MIXED_BUCKETS_PER_DOUBLING
# sizes per doubling, since each padding row costs its share of a compute-bound GEMM. Chosen by
# a step A/B, `--sections mixed` (bench/results/README.md, "Mixed graph buckets").
_MIXED_POWER_OF_TWO_UP_TO = 256
_MIXED_BUCKETS_PER_DOUBLING = 8
# The shortest decode length class: at 512 tokens batch 1 already splits into the 8 segments of
# one KV tile each that its minimum segment allows.
_SHORTEST_LENGTH_CLASS = 512


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a decode graph: small powers of two, then every multiple of 16."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def decode_length_classes(max_seq_len: int) -> list[int]:
    """Bounds on a decode step's longest sequence that may get their own graph: powers of two
    from 512 below ``max_seq_len``, then ``max_seq_len``."""
    classes, bound = [], _SHORTEST_LENGTH_CLASS
    while bound < max_seq_len:
        classes.append(bound)
        bound *= 2
    return classes + [max_seq_len]


def mixed_token_buckets(max_tokens: int) -> list[int]:
    """Token counts that get a mixed-step graph: 16..256 by powers of two, then eight sizes per
    doubling (256, 288, ..., 512, 576, ...), so a step pads at most 1/8 more rows than it has.
    With steps of 256, 8 decodes beside a 512-token prompt ran as 768 rows."""
    sizes = []
    size = 16
    while size < min(max_tokens, _MIXED_POWER_OF_TWO_UP_TO):
        sizes.append(size)
        size *= 2
    while size < max_tokens:
        sizes.append(size)
        size += (1 << (size.bit_length() - 1)) // _MIXED_BUCKETS_PER_DOUBLING
    return sizes + [max_tokens]


@dataclass(frozen=True)
class GraphKey:
    """A graph's padded shape: ``num_seqs`` sequences holding ``num_tokens`` query tokens, none
    longer than ``max_seq_len`` (what attention cuts its KV splits for)."""

    decode: bool
    num_seqs: int
    num_tokens: int
    max_seq_len: int


class StepGraphs:
    """The step graphs of one model instance, over its input buffers, sized by its limits."""

    def __init__(
        self,
        model: torch.nn.Module,
        buffers: InputBuffers,
        attention: AttentionBackend,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        limits: StepLimits,
        mixed: bool = True,
        local_layers: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.local_layers = local_layers
        self.buffers = buffers
        self.attention = attention
        self.kv_cache = kv_cache
        self.cos_sin_cache = cos_sin_cache
        self.max_batch = limits.max_num_seqs
        self.max_seq_len = limits.max_model_len
        self.buckets = decode_buckets(self.max_batch)
        self.length_classes = decode_length_classes(self.max_seq_len)
        # Per batch bucket, the bound each length class's steps run on (derived once: the
        # lookup is on every step's path).
        self._class_bounds = {b: self._graph_bounds(b) for b in self.buckets}
        # Mixed graphs only where the step can have more tokens than sequences.
        self.token_buckets = mixed_token_buckets(limits.max_num_batched_tokens) if mixed else []
        # Per mixed bucket, the attention grid it offers (derived once: the lookup is on every
        # mixed step's path); None: no limit.
        self._mixed_grids = {size: attention.graph_grid(size) for size in self.token_buckets}
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        # Seconds of the captures' eager warm-up passes (where the kernels of a new shape are
        # compiled or loaded from Triton's cache) and of the captures themselves, summed.
        self.warmup_seconds = 0.0
        self.record_seconds = 0.0
        # Seconds of the compile-ahead pass over every bucket, where one ran (before the
        # captures, whose warm-ups then find the kernels compiled), and what it compiled and
        # found in Triton's cache.
        self.compile_seconds = 0.0
        self.compile_counts = CompileCounts()

    # -- choosing a graph ---------------------------------------------------------------------

    def bucket_for(self, batch: int, max_seq_len: int | None = None) -> GraphKey | None:
        """The decode graph for ``batch`` one-token sequences none longer than ``max_seq_len``
        (None: the model's length), or None past the largest batch."""
        classes = self.length_classes
        i = min(bisect_left(classes, max_seq_len or classes[-1]), len(classes) - 1)
        for size in self.buckets:
            if size >= batch:
                return GraphKey(True, size, size, self._class_bounds[size][i])
        return None

    def mixed_bucket_for(self, num_tokens: int, num_seqs: int, grid: int = 0) -> GraphKey | None:
        """The mixed-step graph for this many tokens whose attention grid holds ``grid``
        programs, or None past the largest."""
        if num_seqs > self.max_batch:
            return None
        grids, buckets = self._mixed_grids, self.token_buckets
        for size in buckets[bisect_left(buckets, num_tokens) :]:
            if grids[size] is None or grids[size] >= grid:
                return GraphKey(False, self.max_batch, size, self.max_seq_len)
        return None

    def mixed_grid(self, key: GraphKey) -> int | None:
        """The attention grid the mixed graph ``key`` offers."""
        return self._mixed_grids[key.num_tokens]

    def _graph_bounds(self, batch: int) -> list[int]:
        """For each length class, the bound of the graph its steps take at ``batch``: the
        largest class that attention plans alike (the same graph), so classes that plan alike
        share one capture."""
        classes = self.length_classes
        variants = [self.attention.decode_variant(batch, c) for c in classes]
        bounds = []
        for i in range(len(classes)):
            j = i
            while j + 1 < len(classes) and variants[j + 1] == variants[i]:
                j += 1
            bounds.append(classes[j])
        return bounds

    @property
    def all_keys(self) -> list[GraphKey]:
        """Every graph: each batch bucket once per distinct length bound, then the mixed ones."""
        decode = [
            GraphKey(True, b, b, bound)
            for b in self.buckets
            for bound in sorted(set(self._class_bounds[b]))
        ]
        mixed = [GraphKey(False, self.max_batch, t, self.max_seq_len) for t in self.token_buckets]
        return decode + mixed

    def clear(self) -> None:
        """Drop every graph and their memory pool (captured again when next needed)."""
        self._graphs.clear()
        self._pool = None

    @property
    def captured(self) -> list[GraphKey]:
        return list(self._graphs)

    # -- running ------------------------------------------------------------------------------

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Run the key's graph (capturing it first if needed) over the input buffers as they are.

        Returns the decode graph's logits ``[num_seqs, vocab]``, or the mixed graph's hidden rows
        at ``sample_indices`` ``[num_seqs, hidden]``.
        """
        self.capture(key)
        graph, output = self._graphs[key]
        graph.replay()
        return output

    def capture(self, key: GraphKey) -> None:
        """Capture the key's graph now if it has none, over the input buffers as they are
        (at start-up: the runner stages a padded empty step first)."""
        if key not in self._graphs:
            self._graphs[key] = self._capture(key)

    def _context(self, key: GraphKey) -> ForwardContext:
        buf, s, t = self.buffers.block(key.decode), key.num_seqs, key.num_tokens
        # Only "one query per sequence or not" matters to the kernels (their tile choice).
        max_query_len = 1 if key.decode else t
        grid = 0 if key.decode else (self.mixed_grid(key) or 0)
        return ForwardContext(
            positions=buf["positions"][:t],
            slot_mapping=buf["slot_mapping"][:t],
            query_start_loc=buf["query_start_loc"][: s + 1],
            seq_lens=buf["seq_lens"][:s],
            block_tables=buf["block_tables"][:s],
            max_query_len=max_query_len,
            max_seq_len=key.max_seq_len,
            attention=self.attention.metadata(
                buf, StagedAttention(grid=grid), s, max_query_len, key.max_seq_len
            ),
            **local_context(buf, self.local_layers, t, s),
        )

    def _forward(self, key: GraphKey) -> torch.Tensor:
        buf = self.buffers.block(key.decode)
        hidden = self.model(
            buf["input_ids"][: key.num_tokens],
            self._context(key),
            self.cos_sin_cache,
            self.kv_cache,
        )
        if key.decode:
            return self.model.compute_logits(hidden)
        return hidden.index_select(0, buf["sample_indices"][: key.num_seqs])

    def forward_for_launches(self, key: GraphKey) -> None:
        """The key's forward pass over the buffers as they are, for the kernel launches it
        makes (inside `ember.kernels.compile_ahead`, where none runs): its output is garbage."""
        self._forward(key)

    def _capture(self, key: GraphKey) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The buffers already hold this step's (padded) inputs, so warm-up and capture see
        # valid indices; the warm-up rewrites the same K/V the replay will write.
        started = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(key)
        side.synchronize()  # the warm-up's time apart (the capture below syncs anyway)
        torch.cuda.current_stream().wait_stream(side)
        warmed = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a model loads on the engine's worker thread while the loop thread steps
        # the other models; their CUDA calls must not invalidate this thread's capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = self._forward(key)
        if self._pool is None:
            self._pool = graph.pool()
        self.warmup_seconds += warmed - started
        self.record_seconds += time.perf_counter() - warmed
        logger.debug("captured a CUDA graph for %s", key)
        return graph, output
