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
passed counts against nobody's admission. A model that mixes full-attention layers with windowed
(or chunked) ones keeps its windowed layers' K/V in a pool of their own with a table of their
own (``local_blocks``): the full layers' table keeps every block, the local one gives blocks back
as above (a chunked layer counts as a window of its chunk's size). A request is admitted when
both pools have room; the local pool is sized for every running sequence's window
(`ember.engine.model_plan.ModelPlan.local_kv_blocks`), so in practice the full layers' pool
alone decides. Under prefix caching a local block is registered under the same key as the full
one of those tokens, and a request takes back a cached prefix only as far as the local pool still
holds the blocks that its next query's window reaches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

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


@dataclass(frozen=True)
class LocalBlocks:
    """The windowed layers' own pool of a model that mixes them with full-attention layers:
    ``num_blocks`` (the scratch block included) and the longest span of keys behind a query
    that one of them reads (``window``)."""

    num_blocks: int
    window: int


class NewBlocks(NamedTuple):
    """Blocks an allocation added to a request's table and, with `LocalBlocks`, to its local
    table."""

    main: Sequence[int]
    local: Sequence[int]


class KVCacheManager:
    """Grows each request's block table as its tokens arrive, and frees it when it ends. With
    ``prefix_caching``, a request starts from the longest prefix of its tokens already cached
    (`claim_cached_prefix`) and leaves its full blocks cached for later ones. ``window``: every
    layer's (the largest), which frees the blocks behind it; ``local_blocks``: the windowed
    layers' own pool, for a model whose other layers read every key."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        window: int | None = None,
        local_blocks: LocalBlocks | None = None,
    ) -> None:
        for span in (window, local_blocks.window if local_blocks else None):
            if span is not None and span < 1:
                raise ValueError(f"a window holds at least one key, not {span}")
        if window is not None and local_blocks is not None:
            raise ValueError("a model whose every layer is windowed has no local pool")
        self.block_size = block_size
        # Every layer's window (the largest of them), or None: some layer reads every key.
        self.window = window
        self.pool = BlockPool(num_blocks)
        # The windowed layers' pool and tables, for a model that mixes them with full ones.
        self.local_pool = BlockPool(local_blocks.num_blocks) if local_blocks else None
        self.local_window = local_blocks.window if local_blocks else None
        self.prefix_caching = prefix_caching
        self.stats = PrefixCacheStats()
        self._hasher = BlockHasher(block_size, new_secret())
        self._blocks: dict[str, list[int]] = {}
        self._local_blocks: dict[str, list[int]] = {}

    @property
    def release_window(self) -> int | None:
        """The window behind which the table that gives blocks back (the local one, else the
        only one) frees them; None: no table does."""
        return self.local_window if self.local_pool is not None else self.window

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def local_block_ids(self, request_id: str) -> list[int] | None:
        """The request's local table (None without a local pool)."""
        if self.local_pool is None:
            return None
        return self._local_blocks.get(request_id, [])

    def allocate_slots(self, request_id: str, total_tokens: int) -> NewBlocks | None:
        """Make room for `total_tokens` tokens of the request; return the newly added block ids
        of each table, or None (and change nothing) when a pool cannot supply them."""
        needed = self.blocks_needed(total_tokens)
        owned = self._blocks.setdefault(request_id, [])
        missing = needed - len(owned)
        local = self.local_pool
        if missing <= 0:
            if local is not None and not owned:  # a request with no token yet: both tables
                self._local_blocks.setdefault(request_id, [])
            return _NO_NEW_BLOCKS
        new = self.pool.allocate(missing)
        if new is None:
            if not owned:
                del self._blocks[request_id]
            return None
        if local is None:
            owned.extend(new)
            return NewBlocks(new, ())
        local_owned = self._local_blocks.setdefault(request_id, [])
        new_local = local.allocate(needed - len(local_owned))
        if new_local is None:
            self.pool.release(new)
            if not owned:
                del self._blocks[request_id]
                del self._local_blocks[request_id]
            return None
        owned.extend(new)
        local_owned.extend(new_local)
        return NewBlocks(new, new_local)

    def claim_cached_prefix(self, request: Request) -> int:
        """Give a request about to start (nothing computed, nothing held) the cached blocks of
        its longest cached prefix (with a local pool, as far as `_local_prefix` allows), and
        count them as computed; returns the tokens claimed (given back with `free` if the
        request cannot start after all). At least one token is left to compute: its step
        samples the next one. A request that asks for its prompt's logprobs computes every
        position."""
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
        count, first_local, local_hits = self._local_prefix(keys, len(hits))
        del hits[count:]
        if not hits:
            return 0
        self.pool.share(hits)
        self._blocks[request.request_id] = hits
        if self.local_pool is not None:
            self.local_pool.share(local_hits)
            self._local_blocks[request.request_id] = [SCRATCH_BLOCK] * first_local + local_hits
            request.num_released_blocks = first_local
        request.num_cached_blocks = len(hits)
        request.num_computed_tokens = len(hits) * self.block_size
        return request.num_computed_tokens

    def _local_prefix(self, keys: list[bytes], count: int) -> tuple[int, int, list[int]]:
        """How much of a prefix of ``count`` cached blocks the local pool lets a request take
        back: the longest whose blocks within the next query's window it still holds, as
        ``(blocks of the prefix, index of the first local block, the local blocks from there)``
        (the blocks before that index are out of the window). Without a local pool, all of
        it."""
        local = self.local_pool
        if local is None:
            return count, 0, []
        block_of, window, size = local.block_of, self.local_window, self.block_size
        while count > 0:
            first = max(0, count * size - window + 1) // size
            missing = next(
                (i for i in range(count - 1, first - 1, -1) if keys[i] not in block_of), None
            )
            if missing is None:
                return count, first, [block_of[keys[i]] for i in range(first, count)]
            count = missing
        return 0, 0, []

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
        if self.local_pool is not None:  # its live entries (released ones left registered)
            table, register = self._local_blocks[request.request_id], self.local_pool.register
            for i in range(max(first, request.num_released_blocks), full):
                register(table[i], keys[i])
        request.num_cached_blocks = full

    def release_out_of_window(self, request: Request) -> int:
        """Give back the request's blocks that no query from its next one on can see (each
        wholly below ``num_computed_tokens - window + 1``; the local table's, with a local
        pool), registering full ones first; their entries become the scratch block. Returns how many blocks at the head of its table are
        released when this call released any, else 0. The step that
        reads them last is already launched: a block handed out again is written only by a
        later step, after it on the device."""
        window = self.release_window
        if window is None:
            return 0
        below = max(0, request.num_computed_tokens - window + 1) // self.block_size
        local = self.local_pool is not None
        table = (self._local_blocks if local else self._blocks).get(request.request_id)
        first = request.num_released_blocks
        if table is None or below <= first:
            return 0
        self.cache_full_blocks(request)
        below = min(below, len(table))
        if self.prefix_caching:  # a block leaves registered (its tokens known on the host)
            below = min(below, request.num_cached_blocks)
        if below <= first:
            return 0
        (self.local_pool if local else self.pool).release(table[first:below])
        table[first:below] = [SCRATCH_BLOCK] * (below - first)
        request.num_released_blocks = below
        return below

    def free(self, request: Request) -> None:
        """Let go of the request's blocks, registering its full ones first."""
        blocks = self._blocks.get(request.request_id)
        if blocks is not None:
            self.cache_full_blocks(request)
            del self._blocks[request.request_id]
            local = self._local_blocks.pop(request.request_id, None)
            if local is not None:
                self.local_pool.release(local[request.num_released_blocks :])
                self.pool.release(blocks)
            else:
                self.pool.release(blocks[request.num_released_blocks :])
        request.num_cached_blocks = 0
        request.num_released_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the KV memory was released or overwritten)."""
        self.pool.forget_all()
        if self.local_pool is not None:
            self.local_pool.forget_all()

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get, cached ones included (they are reused when needed)."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests."""
        return 1.0 - self.pool.num_free / self.pool.capacity

    def check_invariants(self, live_request_ids: set[str]) -> None:
        """Every block of each pool is free or held by live requests, as many as its reference
        count says; every key names one block and back; a local table is as long as the main
        one (AssertionError if not)."""
        assert set(self._blocks) <= live_request_ids, (
            f"blocks held by ended requests: {set(self._blocks) - live_request_ids}"
        )
        if self.local_pool is None:
            _check_pool(self.pool, self._blocks)
            return
        assert set(self._local_blocks) == set(self._blocks), "a table without its local one"
        for request_id, ids in self._blocks.items():
            assert SCRATCH_BLOCK not in ids, "the full layers' table released a block"
            assert len(self._local_blocks[request_id]) == len(ids), "the tables' lengths differ"
        _check_pool(self.pool, self._blocks)
        _check_pool(self.local_pool, self._local_blocks)


# The common case (the tokens fit the blocks held), shared: nothing appends to it.
_NO_NEW_BLOCKS = NewBlocks((), ())


def _check_pool(pool: BlockPool, tables: dict[str, list[int]]) -> None:
    """`KVCacheManager.check_invariants` of one pool and the tables that hold its blocks."""
    holders = [0] * pool.num_blocks
    for ids in tables.values():
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
