"""Step inputs: one buffer per block, uploads merged into as few copies as the layout allows,
and the device-side feed of tokens sampled by the step in flight."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch
from helpers.eager_graphs import planned_attention

from ember.config import StepLimits
from ember.runner.input_buffers import MERGE_GAP_BYTES, InputBlock, InputBuffers, merged_runs
from ember.runner.model_runner import ModelRunner

CPU = torch.device("cpu")


def _decode_counts(batch: int, gathers: int) -> dict[str, int]:
    """What a decode step of ``batch`` sequences uploads (`_StepPlan.upload_counts`)."""
    return {
        "input_ids": batch,
        "positions": batch,
        "slot_mapping": batch,
        "query_start_loc": batch + 1,
        "seq_lens": batch,
        "block_tables": batch,
        "sample_indices": batch,
        "gather_dst": gathers,
        "gather_src": gathers,
    }


def test_merged_runs_joins_close_ranges_only():
    assert merged_runs([(100, 200), (0, 10), (10, 10), (205, 300)], max_gap=8) == [
        (0, 10),
        (100, 300),
    ]
    assert merged_runs([(0, 10), (50, 60)], max_gap=40) == [(0, 60)]
    assert merged_runs([(0, 10), (50, 60)], max_gap=39) == [(0, 10), (50, 60)]
    assert merged_runs([(0, 0)], max_gap=8) == []


def test_views_are_aligned_disjoint_and_shaped_by_the_layout():
    block = InputBlock(max_tokens=300, max_seqs=24, max_blocks_per_seq=7, device=CPU)
    spans = []
    for name, (shape, dtype) in block.layout.items():
        view = block[name]
        assert view.shape == shape and view.dtype == dtype
        start = block.offsets[name]
        assert start % 16 == 0
        spans.append((start, start + view.numel() * dtype.itemsize))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in pairwise(spans))
    assert spans[-1][1] <= block.nbytes == block.device_buffer.numel()


def test_a_decode_step_uploads_in_one_copy_and_a_long_prefill_in_several():
    limits = StepLimits(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    attention = planned_attention(32, 8, 128, limits)
    buffers = InputBuffers(limits, 16, CPU, attention)
    for batch in (1, 64, 256):
        assert len(buffers.decode.upload_runs(_decode_counts(batch, batch))) == 1
    prefill = {
        **_decode_counts(2, 0),
        "input_ids": 3000,
        "positions": 3000,
        "slot_mapping": 3000,
        "chunk_tiles": 94,
    }
    runs = buffers.general.upload_runs(prefill)
    assert 1 < len(runs) <= 4  # the token arrays' unused tails stay behind
    copied = sum(end - start for start, end in runs)
    assert copied < buffers.general.nbytes // 2
    assert all(b[0] - a[1] > MERGE_GAP_BYTES for a, b in pairwise(runs))


def test_upload_copies_the_used_rows_of_every_input():
    block = InputBlock(max_tokens=40, max_seqs=6, max_blocks_per_seq=5, device=CPU)
    block.device_buffer.fill_(0xAB)
    staging = block.next_staging()
    counts = {
        "input_ids": 9,
        "positions": 9,
        "slot_mapping": 9,
        "query_start_loc": 4,
        "seq_lens": 3,
        "block_tables": 3,
        "sample_indices": 3,
        "gather_dst": 2,
        "gather_src": 2,
    }
    rng = np.random.default_rng(0)
    for name in counts:
        array = staging.numpy(name)
        array[...] = rng.integers(-1000, 1000, size=array.shape)
    block.upload(staging, counts)
    for name, n in counts.items():
        assert torch.equal(block[name][:n], staging.views[name][:n]), name
    assert block.next_staging() is not staging  # double-buffered
    assert block.next_staging() is staging


def _block_with_gather(dst: list[int], src: list[int]) -> tuple[InputBlock, object]:
    block = InputBlock(max_tokens=8, max_seqs=8, max_blocks_per_seq=2, device=CPU)
    staging = block.next_staging()
    staging.numpy("gather_dst")[: len(dst)] = dst
    staging.numpy("gather_src")[: len(src)] = src
    staging.numpy("input_ids")[:] = -1
    block.upload(staging, {"input_ids": 8, "gather_dst": len(dst), "gather_src": len(src)})
    return block, staging


def test_fed_tokens_land_where_the_gather_says():
    sampled = torch.tensor([70, 71, 72, 73])
    block, staging = _block_with_gather([0, 1, 2], [0, 1, 2])  # steady decode: one copy
    ModelRunner._gather_fed_tokens(block, staging, 3, sampled)
    assert block["input_ids"].tolist() == [70, 71, 72, -1, -1, -1, -1, -1]
    block, staging = _block_with_gather([5, 1, 3], [2, 0, 3])  # a reordered batch: a gather
    ModelRunner._gather_fed_tokens(block, staging, 3, sampled)
    assert block["input_ids"].tolist() == [-1, 70, -1, 73, -1, 72, -1, -1]
