"""Paged KV cache bookkeeping: which blocks of the pool each request holds, and which full blocks
are kept, after their request ends, for later requests that start with the same tokens.

The tensors themselves live with the runner; this module only hands out block ids. Block 0 is
kept back as a scratch block (padded CUDA-graph slots may point at it), so a pool of N blocks
serves N - 1 to requests.

Prefix caching (automatic, as vLLM's V1): every full block whose K/V a launched step has written
is registered under its key (`ember.engine.block_hashes`), which names the tokens of the whole
prefix up to its end. A block is referenced by every request whose table holds it; when the last
one lets go, a registered block stays in the free list with its contents, and a request that
arrives with the same prefix takes it back instead of computing it again. Free blocks are
reused least recently freed first, unregistered ones before any registered one, and a registered
block loses its key only when it is reused. A shared block is never written: a request only
appends to blocks past its last full one.

Sliding windows: in a model whose every layer attends through a window (Mistral's), a query at
position p reads no key below p - window + 1, so the blocks wholly below the next query's window
go back to the pool as the request advances (cached ones stay cached), and their table entries
point at the scratch block: a long sequence holds about window / block_size blocks, and what it
passed counts against nobody's admission. A model with any full-attention layer keeps every
block (its layers share one table).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ember.engine.block_hashes import BlockHasher, new_secret
from ember.engine.request import Request

# Kept back from requests: padded CUDA-graph slots and released table entries point at it.
SCRATCH_BLOCK = 0


class BlockPool:
    """Block ids with a reference count each, and the free ones in the order to reuse them."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Reused from the front: unregistered blocks go there, registered ones to the back.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(SCRATCH_BLOCK + 1, num_blocks)
        )
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.block_of: dict[bytes, int] = {}  # the registered blocks, by key

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def capacity(self) -> int:
        """Blocks that requests can hold (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        return len(self.block_of)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks (a registered one reused loses its key), or None."""
        free = self.free
        if count > len(free):
            return None
        blocks = []
        for _ in range(count):
            block, _ = free.popitem(last=False)
            key = self.key_of[block]
            if key is not None:
                self.key_of[block] = None
                del self.block_of[key]
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (registered blocks a request takes back)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """One reference less to each of ``blocks``; a block nobody holds becomes free. A
        request's last blocks are released first, so its first ones (the prefix other requests
        are likeliest to share) are reused last."""
        ref_counts, free, key_of = self.ref_counts, self.free, self.key_of
        for block in reversed(blocks):
            ref_counts[block] -= 1
            if ref_counts[block] == 0:
                free[block] = None
                if key_of[block] is None:
                    free.move_to_end(block, last=False)

    def register(self, block: int, key: bytes) -> None:
        """Key ``block``'s contents, unless another block already holds that prefix (two
        requests computed it at once: the first stays the cached one)."""
        if key not in self.block_of and self.key_of[block] is None:
            self.block_of[key] = block
            self.key_of[block] = key

    def forget_all(self) -> None:
        """Drop every key (the KV tensors' contents are gone); no block may be held."""
        assert not any(self.ref_counts), "forget_all() with blocks still held"
        self.block_of.clear()
        self.key_of = [None] * self.num_blocks


@dataclass
class PrefixCacheStats:
    """Cumulative since start, in tokens of the requests admitted: looked up in the cache, and
    found there (a preempted request counts again when it is admitted again)."""

    queries: int = 0
    hits: int = 0

    def record_admission(self, num_tokens: int, num_cached: int) -> None:
        self.queries += num_tokens
        self.hits += num_cached


class KVCacheManager:
    """Grows each request's block table as its tokens arrive, and frees it when it ends. With
    ``prefix_caching``, a request starts from the longest prefix of its tokens already cached
    (`claim_cached_prefix`) and leaves its full blocks cached for later ones."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        window: int | None = None,
    ) -> None:
        if window is not None and window < 1:
            raise ValueError(f"a window holds at least one key, not {window}")
        self.block_size = block_size
        # Every layer's window (the largest of them), or None: some layer reads every key.
        self.window = window
        self.pool = BlockPool(num_blocks)
        self.prefix_caching = prefix_caching
        self.stats = PrefixCacheStats()
        self._hasher = BlockHasher(block_size, new_secret())
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

    def claim_cached_prefix(self, request: Request) -> int:
        """Give a request about to start (nothing computed, nothing held) the cached blocks of
                its longest cached prefix, and count them as computed; returns the tokens claimed (given back
        with `free` if the request cannot start after all). At
                least one token is left to compute: its step samples the next one. A request that asks
                for its prompt's logprobs computes every position."""
        if (
            not self.prefix_caching
            or request.num_computed_tokens
            or request.params.prompt_logprobs is not None
        ):
            return 0
        prompt, outputs = request.prompt_token_ids, request.output_token_ids
        num_tokens = len(prompt) + len(outputs)
        usable = (num_tokens - 1) // self.block_size
        keys = request.block_hashes
        self._hasher.extend(keys, prompt, outputs, usable)
        block_of, hits = self.pool.block_of, []
        for key in keys[:usable]:
            block = block_of.get(key)
            if block is None:
                break
            hits.append(block)
        if not hits:
            return 0
        self.pool.share(hits)
        self._blocks[request.request_id] = hits
        request.num_cached_blocks = len(hits)
        request.num_computed_tokens = len(hits) * self.block_size
        return request.num_computed_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose tokens are known on the host and whose K/V
        launched steps have written. Call it before scheduling the request's next tokens: a
        block registered then is read by later steps only, never by the step writing it."""
        if not self.prefix_caching:
            return
        prompt, outputs = request.prompt_token_ids, request.output_token_ids
        full = min(request.num_computed_tokens, len(prompt) + len(outputs)) // self.block_size
        first = request.num_cached_blocks
        if full <= first:
            return
        keys = request.block_hashes
        self._hasher.extend(keys, prompt, outputs, full)
        table, register = self._blocks[request.request_id], self.pool.register
        for i in range(first, full):
            register(table[i], keys[i])
        request.num_cached_blocks = full

    def release_out_of_window(self, request: Request) -> int:
        """Give back the request's blocks that no query from its next one on can see (each
        wholly below ``num_computed_tokens - window + 1``), registering full ones first; their
        entries become the scratch block. Returns how many blocks at the head of its table are
        released when this call released any, else 0. The step that
        reads them last is already launched: a block handed out again is written only by a
        later step, after it on the device."""
        if self.window is None:
            return 0
        below = max(0, request.num_computed_tokens - self.window + 1) // self.block_size
        table = self._blocks.get(request.request_id)
        first = request.num_released_blocks
        if table is None or below <= first:
            return 0
        self.cache_full_blocks(request)
        below = min(below, len(table))
        if self.prefix_caching:  # a block leaves registered (its tokens known on the host)
            below = min(below, request.num_cached_blocks)
        if below <= first:
            return 0
        self.pool.release(table[first:below])
        table[first:below] = [SCRATCH_BLOCK] * (below - first)
        request.num_released_blocks = below
        return below

    def free(self, request: Request) -> None:
        """Let go of the request's blocks, registering its full ones first."""
        blocks = self._blocks.get(request.request_id)
        if blocks:
            self.cache_full_blocks(request)
            del self._blocks[request.request_id]
            self.pool.release(blocks[request.num_released_blocks :])
        request.num_cached_blocks = 0
        request.num_released_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the KV memory was released or overwritten)."""
        self.pool.forget_all()

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get, cached ones included (they are reused when needed)."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests."""
        return 1.0 - self.pool.num_free / self.pool.capacity

    def check_invariants(self, live_request_ids: set[str]) -> None:
        """Every block is free or held by live requests, as many as its reference count says;
        every key names one block and back (AssertionError if not)."""
        pool = self.pool
        assert set(self._blocks) <= live_request_ids, (
            f"blocks held by ended requests: {set(self._blocks) - live_request_ids}"
        )
        holders = [0] * pool.num_blocks
        for ids in self._blocks.values():
            held = [b for b in ids if b != SCRATCH_BLOCK]
            assert len(held) == len(set(held)), "a request holds a block twice"
            released = len(ids) - len(held)
            assert ids[:released] == [SCRATCH_BLOCK] * released, "a released block not first"
            for block in held:
                holders[block] += 1
        assert holders == pool.ref_counts, "a reference count disagrees with the tables"
        free = set(pool.free)
        assert len(free) == len(pool.free)
        held = {b for b in range(1, pool.num_blocks) if holders[b]}
        assert not free & held, "a held block is free"
        assert free | held == set(range(1, pool.num_blocks)), "a block was lost"
        for key, block in pool.block_of.items():
            assert pool.key_of[block] == key, "a cached key names a block keyed otherwise"
        assert sum(k is not None for k in pool.key_of) == len(pool.block_of)
