"""One step as the other tensor-parallel ranks run it.

Rank 0 schedules, stages the step's inputs into its host staging set and uploads them (its
`ModelRunner`); it then sends the other ranks one `ShardStep`: the staged bytes the upload
copied, and the few numbers the forward pass is planned by. Each rank copies the bytes into its
own staging set of the same layout (its input blocks are built from the same limits and
attention shapes) and uploads them, so every rank's device inputs are rank 0's. A decode that
feeds a token still on rank 0's device (overlap) gets it by a broadcast of the step's
``input_ids`` after rank 0 has gathered it.

Every rank then runs the same collectives in the same order as rank 0's eager step: the
forward pass, the prompt rows' logits (in `row_chunks`), then the sampled rows' logits, whose
gather only rank 0 receives; the other ranks never sample. CUDA graphs are not captured at
tensor_parallel_size > 1 yet, so every rank runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ember.layers.attention import AttentionBackend, StagedAttention
from ember.layers.forward_context import step_context
from ember.runner.input_buffers import HostStaging, InputBlock, InputBuffers
from ember.runner.prompt_scoring import row_chunks


@dataclass(frozen=True)
class ShardStep:
    """What the other ranks need of one launched step. ``runs``: ``(offset, bytes)`` of the
    staged input block that the upload copied; ``counts``: the upload's rows per input."""

    decode: bool
    runs: list[tuple[int, bytes]]
    counts: dict[str, int]
    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    attention: StagedAttention
    num_gathers: int
    num_samples: int
    score_rows: list[int] | None
    max_score_rows: int


def staged_runs(
    block: InputBlock, staging: HostStaging, counts: dict[str, int]
) -> list[tuple[int, bytes]]:
    """The bytes an upload of ``counts`` copies from ``staging``, by their offset."""
    packed = staging.packed.numpy()
    return [(start, packed[start:end].tobytes()) for start, end in block.upload_runs(counts)]


class ShardRunner:
    """A worker rank's part of each step: its shard of the model, its KV cache and its input
    buffers (the layout of rank 0's)."""

    def __init__(
        self,
        model: torch.nn.Module,
        attention: AttentionBackend,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        buffers: InputBuffers,
        local_layers: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.local_layers = local_layers
        self.attention = attention
        self.kv_cache = kv_cache
        self.cos_sin_cache = cos_sin_cache
        self.buffers = buffers

    @torch.inference_mode()
    def run(self, step: ShardStep) -> None:
        """Stage and upload ``step``'s inputs, then take part in its collectives."""
        block = self.buffers.block(step.decode)
        staging = block.next_staging()
        packed = staging.packed.numpy()
        for offset, data in step.runs:
            packed[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        block.upload(staging, step.counts)
        input_ids = block["input_ids"][: step.num_tokens]
        if step.num_gathers:
            self.model.parallel.broadcast(input_ids)
        ctx = step_context(
            self.attention,
            block,
            step.num_tokens,
            step.num_seqs,
            step.max_query_len,
            step.max_seq_len,
            step.attention,
            self.local_layers,
        )
        hidden = self.model(input_ids, ctx, self.cos_sin_cache, self.kv_cache)
        if step.score_rows:
            rows = torch.tensor(step.score_rows, dtype=torch.long).to(hidden.device)
            for index in row_chunks(len(rows), step.max_score_rows):
                self.model.compute_logits(hidden.index_select(0, rows[index]))
        if step.num_samples:
            sampled = hidden.index_select(0, block["sample_indices"][: step.num_samples])
            self.model.compute_logits(sampled)
