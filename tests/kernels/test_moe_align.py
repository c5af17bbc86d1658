"""Aligning a MoE layer's pairs into blocks of one expert: the buffers' invariants, on the Triton
program (the interpreter on a CPU) and on the torch-ops path, which must agree exactly."""

from __future__ import annotations

import pytest
import torch
from helpers.moe_reference import routing

from ember.kernels.moe_align import align_pairs, align_with_kernel, align_with_torch, max_blocks

ALIGNERS = {"kernel": align_with_kernel, "torch": align_with_torch}


def check_blocks(blocks, ids: torch.Tensor, num_experts: int) -> None:
    """Every pair on exactly one row, in its expert's run; each expert's run starting a block;
    padding and unused rows the sentinel; used blocks first, one expert each, -1 past them."""
    block_m = blocks.block_m
    pairs = ids.numel()
    sorted_ids = blocks.sorted_ids.cpu().long()
    expert_of_block = blocks.expert_of_block.cpu().long()
    used = int(blocks.used_blocks.item())
    ids = ids.cpu().long()
    assert sorted_ids.numel() == expert_of_block.numel() * block_m
    assert expert_of_block.numel() == max_blocks(pairs, num_experts, block_m)

    is_pair = sorted_ids < pairs
    assert ((sorted_ids == pairs) | is_pair).all(), "a row is neither a pair nor the sentinel"
    assert torch.equal(sorted_ids[is_pair].sort().values, torch.arange(pairs))  # each once

    counts = torch.bincount(ids, minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m).sum())
    assert not is_pair[used * block_m :].any()
    assert (expert_of_block[used:] == -1).all()
    row_expert = expert_of_block.repeat_interleave(block_m)
    assert torch.equal(ids[sorted_ids[is_pair]], row_expert[is_pair]), "a block mixes experts"
    for expert in range(num_experts):
        blocks_of_expert = (expert_of_block == expert).nonzero().flatten()
        assert len(blocks_of_expert) == -(-int(counts[expert]) // block_m)
        if len(blocks_of_expert):
            # One run of whole blocks: its pairs first, in pair order, then padding.
            run = sorted_ids[blocks_of_expert[0] * block_m : (blocks_of_expert[-1] + 1) * block_m]
            assert torch.equal(run[: counts[expert]], (ids == expert).nonzero().flatten())
            assert (run[counts[expert] :] == pairs).all()


@pytest.mark.parametrize("aligner", sorted(ALIGNERS))
@pytest.mark.parametrize(
    ("kind", "tokens", "num_experts", "top_k", "block_m"),
    [
        ("random", 40, 8, 2, 16),
        ("random", 1, 128, 8, 16),  # a Qwen3-30B-A3B decode: 8 blocks of one pair
        ("random", 33, 6, 4, 32),
        ("one_expert", 37, 8, 1, 16),  # one expert takes every token, 3 blocks
        ("one_expert", 20, 8, 2, 16),
        ("some_experts_empty", 25, 8, 2, 16),
    ],
)
def test_alignment_invariants(gen, device, aligner, kind, tokens, num_experts, top_k, block_m):
    ids, _ = routing(kind, tokens, num_experts, top_k, gen)
    ids = ids.reshape(-1).to(device)
    check_blocks(ALIGNERS[aligner](ids, num_experts, block_m), ids, num_experts)


def test_kernel_and_torch_paths_agree_and_align_pairs_routes_by_size(gen, device):
    ids, _ = routing("random", 50, 16, 3, gen)
    ids = ids.reshape(-1).to(device)
    by_kernel = align_with_kernel(ids, 16, 16)
    by_torch = align_with_torch(ids, 16, 16)
    for a, b in zip(by_kernel[:3], by_torch[:3]):
        assert torch.equal(a, b)
    for kernel_max_pairs in (0, 150):
        routed = align_pairs(ids, 16, 16, kernel_max_pairs=kernel_max_pairs)
        assert torch.equal(routed.sorted_ids, by_kernel.sorted_ids)


def test_worst_routing_uses_every_block(device):
    """Four experts of 17 pairs each pad to two blocks each: the buffers' worst case, met."""
    ids = torch.arange(4, dtype=torch.int32).repeat_interleave(17).to(device)
    assert max_blocks(ids.numel(), 4, 16) == 8
    for aligner in ALIGNERS.values():
        blocks = aligner(ids, 4, 16)
        assert int(blocks.used_blocks.item()) == 8
        assert blocks.expert_of_block.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        check_blocks(blocks, ids, 4)


def test_duplicate_experts_in_a_token_and_many_chunks(gen, device):
    """A token may name an expert twice (each pair is its own row); 600 pairs over 8 experts
    take the kernel through several chunks of its loops."""
    ids = torch.randint(0, 8, (600,), generator=gen, dtype=torch.int32).to(device)
    ids[:4] = 5
    by_kernel = align_with_kernel(ids, 8, 16)
    check_blocks(by_kernel, ids, 8)
    assert torch.equal(by_kernel.sorted_ids, align_with_torch(ids, 8, 16).sorted_ids)
