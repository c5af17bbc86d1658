"""Paged KV cache bookkeeping: which blocks of the pool each request owns.

The tensors themselves live with the runner; this module only hands out block ids. Block 0 is
kept back as a scratch block (padded CUDA-graph slots may point at it), so a pool of N blocks
serves N - 1 to requests.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """A free list of block ids."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks that requests can hold (all but the scratch block)."""
        return self.num_blocks - 1

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def release(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class KVCacheManager:
    """Grows each request's block table as its tokens arrive and frees it when it ends."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def allocate_slots(self, request_id: str, total_tokens: int) -> list[int] | None:
        """Make room for `total_tokens` tokens of the request; return the newly added block ids,
        or None (and change nothing) when the pool cannot supply them."""
        owned = self._blocks.setdefault(request_id, [])
        missing = self.blocks_needed(total_tokens) - len(owned)
        if missing <= 0:
            return []
        new = self.pool.allocate(missing)
        if new is None:
            if not owned:
                del self._blocks[request_id]
            return None
        owned.extend(new)
        return new

    def free(self, request_id: str) -> None:
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            self.pool.release(blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests."""
        return 1.0 - self.pool.num_free / self.pool.capacity

    def check_invariants(self, live_request_ids: set[str]) -> None:
        """Every block is free or owned by exactly one live request (AssertionError if not)."""
        owned = [b for ids in self._blocks.values() for b in ids]
        free = list(self.pool._free)
        assert set(self._blocks) <= live_request_ids, (
            f"blocks held by ended requests: {set(self._blocks) - live_request_ids}"
        )
        everything = owned + free
        assert len(everything) == len(set(everything)), "a block is owned twice or free twice"
        assert sorted(everything) == list(range(1, self.pool.num_blocks)), "a block was lost"
