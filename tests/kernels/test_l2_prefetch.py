"""The L2 prefetch kernel: which chunks a launch covers (interpreter), and on a Hopper GPU that
a real prefetch runs, inside a CUDA graph too, and leaves the weight as it was."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.l2_prefetch import CHUNK_BYTES, num_prefetch_chunks, prefetch_to_l2

GUARD = 5


@pytest.mark.parametrize(
    ("num_elements", "max_bytes", "programs", "chunk_bytes"),
    [
        (CHUNK_BYTES // 2 * 3, None, 32, CHUNK_BYTES),  # 3 whole chunks, one program
        (CHUNK_BYTES // 2 * 3 + 100, None, 32, CHUNK_BYTES),  # a short tail is left out
        (CHUNK_BYTES // 2 * 700, None, 32, CHUNK_BYTES),  # several programs, a partial block
        (CHUNK_BYTES // 2 * 700, None, 2, CHUNK_BYTES),  # more chunks than programs x block
        (CHUNK_BYTES // 2 * 700, 5 * CHUNK_BYTES + 7, 32, CHUNK_BYTES),  # capped
        (CHUNK_BYTES // 2 - 8, None, 32, CHUNK_BYTES),  # less than one chunk: no launch
        (5000, None, 3, 48),  # small chunks, odd program count
    ],
)
def test_launch_covers_every_chunk_once_and_nothing_past_the_cap(
    num_elements, max_bytes, programs, chunk_bytes, device
):
    weight = torch.empty(num_elements, dtype=torch.bfloat16, device=device)
    chunks = num_prefetch_chunks(weight, max_bytes, chunk_bytes)
    expected = min(num_elements * 2, max_bytes or num_elements * 2) // chunk_bytes
    assert chunks == expected
    cover = torch.zeros(chunks + GUARD, dtype=torch.int32, device=device)
    prefetch_to_l2(
        weight, max_bytes, num_programs=programs, chunk_bytes=chunk_bytes, coverage=cover
    )
    assert cover[:chunks].eq(1).all()
    assert cover[chunks:].eq(0).all()


def test_rejects_a_strided_weight_and_an_unaligned_chunk(device):
    weight = torch.empty(64, CHUNK_BYTES, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_to_l2(weight.t())
    with pytest.raises(ValueError, match="multiple of 16"):
        prefetch_to_l2(weight, chunk_bytes=1000)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="the bulk L2 prefetch needs a Hopper or later GPU",
)
def test_prefetch_runs_eagerly_and_in_a_graph_and_writes_nothing():
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    before = weight.clone()
    prefetch_to_l2(weight)
    prefetch_to_l2(weight, 8 << 20)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prefetch_to_l2(weight)  # warm-up outside the capture (compiles)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        prefetch_to_l2(weight)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(weight, before)
