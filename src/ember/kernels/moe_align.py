"""Group a MoE layer's (token, slot) pairs by expert into blocks of ``block_m`` rows.

The ``P = T * k`` pairs of ``topk_ids [T, k]`` (pair ``p`` is token ``p // k``, slot ``p % k``)
are laid out expert by expert, in pair order within an expert, each expert's run padded to a
multiple of ``block_m`` rows, so every block of rows belongs to one expert and the grouped GEMMs
(`ember.kernels.moe_gemm`) read that expert's weights once per block. `MoeBlocks`:

- ``sorted_ids`` int32 ``[max_blocks * block_m]``: the pair at each row, ``P`` (the sentinel)
  at padding rows and at every row past the used blocks;
- ``expert_of_block`` int32 ``[max_blocks]``: each used block's expert, -1 past them;
- ``used_blocks`` int32 ``[1]``: the blocks in use (they come first).

Everything stays on the device and the buffers are sized for the worst routing
(`max_blocks`), so a CUDA graph captures the alignment and the GEMMs' fixed grids; programs
of unused blocks read -1 and exit. Two implementations give the same buffers: one Triton
program (one launch, for decode-sized steps) and torch ops around a stable sort (parallel, for
large prefills); `MoeTuning.align_kernel_max_pairs` chooses. Expert ids must lie in ``[0, E)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ember.kernels.compile_ahead import launch

# Elements of a [pairs, experts] one-hot tile the kernel holds at once: registers, not spills.
_ONE_HOT_ELEMS = 8192
# Rows the padding fill stores a step.
_FILL_ROWS = 2048


class MoeBlocks(NamedTuple):
    sorted_ids: torch.Tensor
    expert_of_block: torch.Tensor
    used_blocks: torch.Tensor
    block_m: int


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks the worst routing uses: at most ``min(E, P)`` experts get pairs, and each pads
    fewer than ``block_m`` rows."""
    return (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m


@triton.jit
def _one_hot(ids_ptr, start, pairs, num_experts, experts, CHUNK: tl.constexpr):
    """int32 ``[CHUNK, EXPERTS]``: pair ``start + i`` is routed to expert ``e``."""
    idx = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + idx, mask=idx < pairs, other=-1)
    hit = (ids[:, None] == experts[None, :]) & (experts < num_experts)[None, :]
    return hit.to(tl.int32)


@triton.jit(do_not_specialize=["pairs", "num_blocks"])
def _align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    expert_of_block_ptr,
    used_blocks_ptr,
    pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program: mark every row padding, count each expert's pairs, place every pair at its
    expert's padded start plus its rank among the expert's earlier pairs, and store each
    block's expert. (Marking padding row by row after the placement, by searching the padded
    runs, cost most of the kernel's time once the rows ran to thousands.)"""
    experts = tl.arange(0, EXPERTS)
    for start in range(0, num_blocks * BLOCK_M, FILL):
        rows = start + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + rows, pairs, mask=rows < num_blocks * BLOCK_M)
    # The placement below overwrites some of those rows: every thread's fill stores first.
    tl.debug_barrier()
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    for start in range(0, pairs, CHUNK):
        counts += tl.sum(_one_hot(ids_ptr, start, pairs, num_experts, experts, CHUNK), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(used_blocks_ptr, tl.sum(padded, 0) // BLOCK_M)

    next_row = starts  # each expert's next free row
    for start in range(0, pairs, CHUNK):
        hit = _one_hot(ids_ptr, start, pairs, num_experts, experts, CHUNK)
        earlier = tl.cumsum(hit, 0) - hit  # the expert's pairs ahead in this chunk
        row = tl.sum(hit * (next_row[None, :] + earlier), 1)
        idx = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + row, idx, mask=tl.sum(hit, 1) > 0)
        next_row += tl.sum(hit, 0)

    # A block's expert is the number of experts whose padded run ends at or before it.
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        expert = tl.sum(((blocks * BLOCK_M)[:, None] >= ends[None, :]).to(tl.int32), 1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(expert_of_block_ptr + blocks, expert, mask=blocks < num_blocks)


def _empty_blocks(pairs: int, num_experts: int, block_m: int, device) -> MoeBlocks:
    blocks = max_blocks(pairs, num_experts, block_m)
    return MoeBlocks(
        torch.empty(blocks * block_m, dtype=torch.int32, device=device),
        torch.empty(blocks, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
        block_m,
    )


def align_with_kernel(ids: torch.Tensor, num_experts: int, block_m: int) -> MoeBlocks:
    """`MoeBlocks` of the flat int32 expert ids ``ids [P]`` from one Triton program."""
    pairs = ids.numel()
    blocks = _empty_blocks(pairs, num_experts, block_m, ids.device)
    experts = triton.next_power_of_2(num_experts)
    chunk = max(16, min(1024, _ONE_HOT_ELEMS // experts))
    launch(
        _align_kernel,
        (1,),
        ids,
        blocks.sorted_ids,
        blocks.expert_of_block,
        blocks.used_blocks,
        pairs,
        num_experts,
        blocks.expert_of_block.numel(),
        BLOCK_M=block_m,
        EXPERTS=experts,
        CHUNK=chunk,
        FILL=_FILL_ROWS,
        num_warps=8 if experts >= 64 else 4,
    )
    return blocks


def align_with_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> MoeBlocks:
    """The same `MoeBlocks` from torch ops: a stable sort by expert places each pair at its
    expert's padded start plus its rank. No host sync, no data-dependent shapes."""
    pairs = ids.numel()
    blocks = _empty_blocks(pairs, num_experts, block_m, ids.device)
    flat = ids.long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    by_expert = flat[order]
    first_pair = counts.cumsum(0) - counts  # each expert's first place in sorted order
    rank = torch.arange(pairs, device=ids.device) - first_pair[by_expert]
    rows = ends[by_expert] - padded[by_expert] + rank
    blocks.sorted_ids.fill_(pairs)
    blocks.sorted_ids.scatter_(0, rows, order.to(torch.int32))
    first_rows = torch.arange(blocks.expert_of_block.numel(), device=ids.device) * block_m
    expert = torch.searchsorted(ends, first_rows, right=True)
    blocks.expert_of_block.copy_(torch.where(expert < num_experts, expert, -1))
    blocks.used_blocks.copy_(ends[-1:] // block_m)
    return blocks


def align_pairs(
    ids: torch.Tensor, num_experts: int, block_m: int, kernel_max_pairs: int
) -> MoeBlocks:
    """`MoeBlocks` of the flat int32 expert ids ``ids [P]`` (``P >= 1``): one Triton program up
    to ``kernel_max_pairs`` pairs, torch's sort past it."""
    if ids.numel() <= kernel_max_pairs:
        return align_with_kernel(ids, num_experts, block_m)
    return align_with_torch(ids, num_experts, block_m)
