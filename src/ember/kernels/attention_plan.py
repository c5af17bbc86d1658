"""How the paged attention kernel launches for a step, decided without Triton.

`AttentionPlanner` turns a step's shape (sequences, longest query, longest sequence) into the
launches `ember.kernels.paged_attention.paged_attention` makes: each launch's tiles, which
sequences it serves, and how a decode's KV range splits into segments ("flash-decoding"). It also
sizes and fills the map of a mixed step's chunk tiles. The numbers it decides by are the device's
`AttentionTuning`, never module constants, so two models in one process each plan for their own
shape on their own GPU. The CPU path imports this module (the runner sizes its buffers from it),
so it must not import Triton.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ember.kernels.tiles import SHARED_MEMORY_BUDGET, shrink_to_fit

# A chunk tile map's entry (`AttentionPlanner.chunk_tile_map`): its sequence above these bits,
# the tile's index within the sequence below.
TILE_BITS = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1), as `triton.next_power_of_2`."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class AttentionTuning:
    """The decode split heuristic and the tiles of one GPU; the defaults are the H200's, chosen
    by `ember bench tune --sections attention` and `ember bench step --sections attention`
    (bench/results/README.md, "Attention splits and tiles").

    While a decode's programs (one per sequence and KV head) do not fill one wave, the step is a
    chain of latencies and splitting down to one tile per segment pays; once they fill it, only
    long segments pay. Tiles are ``(BLOCK_N, num_warps, KV_STAGES)``.
    """

    num_sms: int = 132
    programs_per_sm: int = 2
    min_tokens_per_split_under_one_wave: int = 64
    min_tokens_per_split: int = 1024
    max_splits: int = 32
    # Unsplit decode launches with at least this many programs per SM run one-warp programs:
    # `ember bench tune --sections attention` and a step A/B at batch 64-256
    # (bench/results/README.md, "One-warp decode threshold").
    one_warp_min_programs_per_sm: float = 6.0
    # A mixed step's decodes: at most this many segments each (a grid constant). A step A/B,
    # `--sections mixed` (bench/results/README.md, "Mixed-step decode tiles").
    mixed_decode_splits: int = 4
    split_decode_tiles: tuple[int, int, int] = (64, 4, 2)
    decode_tiles: tuple[int, int, int] = (64, 2, 3)
    one_warp_decode_tiles: tuple[int, int, int] = (32, 1, 3)
    prefill_tiles: tuple[int, int, int] = (128, 8, 2)
    shared_memory_budget: int = SHARED_MEMORY_BUDGET
    # An FP8 cache's K/V tiles widen to bf16 in PTX (`ember.kernels.fp8_widen`), not by
    # Triton's conversions (bench/results/README.md, "FP8 widened in PTX";
    # `--no-fp8-widen-in-registers` turns it off).
    kv_fp8_widen_in_registers: bool = True

    @classmethod
    def for_device(cls, device: torch.device) -> AttentionTuning:
        """The measured table with ``device``'s SM count (an H200's off CUDA, where the CPU
        interpreter runs the kernels)."""
        if device.type != "cuda":
            return cls()
        return cls(num_sms=torch.cuda.get_device_properties(device).multi_processor_count)


class KeyStart(enum.IntEnum):
    """Where the keys a query at position p sees start (the kernel's KEY_START), p itself the
    last: key 0 (causal attention), ``p - window + 1`` (a sliding window of ``window`` keys), or
    ``p // chunk * chunk`` (chunked local attention). docs/CONTRACTS.md, "Windows, sinks, chunks".
    """

    CAUSAL = 0
    WINDOW = 1
    CHUNK = 2


def key_start(window: int | None = None, chunk_size: int | None = None) -> tuple[KeyStart, int]:
    """The `KeyStart` of a layer with ``window`` or ``chunk_size`` (at most one), and its size
    (0 for causal attention)."""
    if window is not None and chunk_size is not None:
        raise ValueError("a layer attends over a sliding window or in chunks, not both")
    if window is not None:
        if window < 1:
            raise ValueError(f"a sliding window holds at least one key, got {window}")
        return KeyStart.WINDOW, int(window)
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"an attention chunk holds at least one key, got {chunk_size}")
        return KeyStart.CHUNK, int(chunk_size)
    return KeyStart.CAUSAL, 0


class Sequences(enum.IntEnum):
    """Which sequences a launch serves: all, or in a mixed step's two launches those of one
    query token (decode tiles) or of more (prefill tiles). The kernel's SEQUENCES constant."""

    ALL = 0
    SINGLE_TOKEN = 1
    MULTI_TOKEN = 2


@dataclass(frozen=True)
class AttentionLaunch:
    """One launch of the paged attention kernel over a step.

    ``tiles``: the kernel's BLOCK_M, BLOCK_Q, BLOCK_N, num_warps and KV_STAGES. ``decode_only``:
    one program per sequence (every query is one token). ``splits``: KV segments per sequence
    (the grid's third axis); each sequence cuts its own range into segments of at least
    ``min_split_tokens``. ``preload_kv``: a decode with RoPE in the kernel loads its first K/V
    tile before the PDL wait. ``chunk_map``: the launch runs one program per entry of the
    step's chunk tile map, when the step has one.
    """

    tiles: dict[str, int] = field(hash=False)
    decode_only: bool
    sequences: Sequences = Sequences.ALL
    splits: int = 1
    min_split_tokens: int = 1
    preload_kv: bool = False
    chunk_map: bool = False


class ChunkTiles(NamedTuple):
    """A mixed step's map of its chunks' query tiles, for the launch on prefill tiles: one
    program per entry of ``tiles[:grid]`` (int32 on the device; -1 past the step's own tiles),
    each ``block_q`` query tokens."""

    tiles: torch.Tensor
    grid: int
    block_q: int


class AttentionPlanner:
    """The launches of one model's attention (its head counts and cache element size) on one
    GPU (`AttentionTuning`). ``elem_bytes`` is the KV cache's element size (1 for an FP8
    cache), what the K/V tiles are sized by; ``query_elem_bytes`` the queries' (None: the
    same)."""

    def __init__(
        self,
        tuning: AttentionTuning,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        elem_bytes: int,
        query_elem_bytes: int | None = None,
    ) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of {num_kv_heads}")
        self.tuning = tuning
        self.num_kv_heads = num_kv_heads
        self.group = num_q_heads // num_kv_heads
        self.head_dim = head_dim
        self.elem_bytes = elem_bytes
        self.query_elem_bytes = query_elem_bytes or elem_bytes
        # A prefill program's rows are query tokens x the group's heads (block_q 0: as many
        # tokens as fill its rows).
        self.prefill_tiles = self._fit(
            self._tiles(_prefill_block_m(self.group), 0, tuning.prefill_tiles)
        )

    # -- decode splits ---------------------------------------------------------------------------

    def under_one_wave(self, num_seqs: int) -> bool:
        """Whether a decode's unsplit programs (one per sequence and KV head) leave SMs idle."""
        return num_seqs * self.num_kv_heads < self.tuning.num_sms

    def min_split_tokens(self, num_seqs: int) -> int:
        """The shortest KV segment worth its own program: one tile while the programs are under
        one wave, `AttentionTuning.min_tokens_per_split` once they fill it. The kernel applies it
        per sequence too, so a grid cut for a longer bound splits no further."""
        if self.under_one_wave(num_seqs):
            return self.tuning.min_tokens_per_split_under_one_wave
        return self.tuning.min_tokens_per_split

    def num_splits(self, num_seqs: int, max_seq_len: int) -> int:
        """KV segments per sequence for a decode-only step: only as many as give every SM
        `AttentionTuning.programs_per_sm` programs, none shorter than `min_split_tokens`."""
        tuning = self.tuning
        programs = max(1, num_seqs * self.num_kv_heads)
        wanted = cdiv(tuning.programs_per_sm * tuning.num_sms, programs)
        by_length = cdiv(max(1, max_seq_len), self.min_split_tokens(num_seqs))
        return max(1, min(wanted, by_length, tuning.max_splits))

    # -- tiles -----------------------------------------------------------------------------------

    def decode_tiles(self, split_kv: bool = False, programs_per_sm: float = 0.0) -> dict[str, int]:
        """A decode launch's tiles: the group's query heads are a program's rows. A decode
        program's tile loop is bound by per-tile latency, so a full grid (``programs_per_sm``)
        takes one-warp programs (no cross-warp reductions)."""
        tuning = self.tuning
        if split_kv:
            shape = tuning.split_decode_tiles
        elif programs_per_sm >= tuning.one_warp_min_programs_per_sm:
            shape = tuning.one_warp_decode_tiles
        else:
            shape = tuning.decode_tiles
        rows = max(16, next_power_of_2(self.group))  # tl.dot needs M >= 16
        return self._fit(self._tiles(rows, 1, shape))

    @property
    def chunk_query_tile(self) -> int:
        """Query tokens a prefill-tile program serves: what the chunk tile map cuts chunks by."""
        return self.prefill_tiles["BLOCK_Q"]

    def _tiles(self, block_m: int, block_q: int, shape: tuple[int, int, int]) -> dict[str, int]:
        block_n, warps, stages = shape
        return {
            "BLOCK_M": block_m,
            "BLOCK_Q": block_q or block_m // self.group,
            "BLOCK_N": block_n,
            "num_warps": warps,
            "KV_STAGES": stages,
        }

    def _fit(self, tiles: dict[str, int]) -> dict[str, int]:
        """Shrink the K/V tiles (then the pipeline depth) of wide heads or fp32 caches until
        they fit one SM's shared memory: fp32 with 128x128 tiles asks for 256 KiB."""
        return fit_shared_memory(
            tiles,
            self.head_dim,
            self.elem_bytes,
            self.tuning.shared_memory_budget,
            self.query_elem_bytes,
        )

    # -- a step's launches -----------------------------------------------------------------------

    def plan(
        self,
        num_seqs: int,
        max_query_len: int,
        max_seq_len: int,
        *,
        pdl: bool = False,
        splits: int | None = None,
    ) -> tuple[AttentionLaunch, ...]:
        """The launches of a step of ``num_seqs`` sequences whose longest query has
        ``max_query_len`` tokens and longest sequence ``max_seq_len`` (host-side bounds; under a
        CUDA graph the bucket's): `decode_plan` where every query is one token, else
        `mixed_plan`."""
        if max_query_len == 1:
            return self.decode_plan(num_seqs, max_seq_len, pdl=pdl, splits=splits)
        if splits is not None and splits > 1:
            raise ValueError("split-KV attention only serves decode-only steps (max_query_len 1)")
        return self.mixed_plan()

    def decode_plan(
        self, num_seqs: int, max_seq_len: int, *, pdl: bool = False, splits: int | None = None
    ) -> tuple[AttentionLaunch, ...]:
        """One launch over a decode-only step, launched with PDL or not. ``splits`` forces the
        segment count (down to one tile a segment); None lets the heuristic choose."""
        if splits is None:
            splits = self.num_splits(num_seqs, max_seq_len)
            min_split_tokens = self.min_split_tokens(num_seqs)
        else:
            min_split_tokens = 1
        programs_per_sm = num_seqs * self.num_kv_heads / self.tuning.num_sms
        tiles = self.decode_tiles(splits > 1, programs_per_sm)
        # Only under PDL is there a wait to hide the first tile's load under; held in registers
        # by a full wave, the preload cost more than it hid. A step A/B at batch 1-128
        # (bench/results/README.md, "K/V preload").
        preload = pdl and splits > 1 and self.under_one_wave(num_seqs)
        launch = AttentionLaunch(
            tiles, True, splits=splits, min_split_tokens=min_split_tokens, preload_kv=preload
        )
        return (launch,)

    def mixed_plan(self) -> tuple[AttentionLaunch, ...]:
        """The two launches of a step with prefill chunks, whatever its shape (so a step gives
        the same numbers eagerly and padded in a CUDA graph): its decodes on decode tiles (a
        long one in up to `AttentionTuning.mixed_decode_splits` segments, cut from its own
        length), its chunks on prefill tiles over the chunk tile map; a decode on prefill tiles
        would compute 4 of a program's 128 rows."""
        tuning = self.tuning
        decodes = AttentionLaunch(
            self.decode_tiles(),
            True,
            Sequences.SINGLE_TOKEN,
            splits=tuning.mixed_decode_splits,
            min_split_tokens=tuning.min_tokens_per_split,
        )
        chunks = AttentionLaunch(self.prefill_tiles, False, Sequences.MULTI_TOKEN, chunk_map=True)
        return decodes, chunks

    # -- the chunk tile map ----------------------------------------------------------------------

    def chunk_tile_bound(self, num_tokens: int, num_seqs: int) -> int:
        """The most chunk tiles a step of ``num_tokens`` query tokens in ``num_seqs`` sequences
        can have: a tile per `chunk_query_tile` tokens, and a partial one per chunk."""
        return num_tokens // self.chunk_query_tile + num_seqs

    def chunk_tile_map(self, query_start_loc: np.ndarray, num_seqs: int, out: np.ndarray) -> int:
        """Write into ``out`` one entry per `chunk_query_tile`-token query tile of each sequence
        with more than one query token (sequence << TILE_BITS | the tile's index within it);
        returns how many. Without a map the chunk launch would need a program per sequence,
        decodes and a graph's padding included, each searching for its sequence (measured by
        `ember bench profile`'s mixed row; bench/results/README.md, "Chunk tile map")."""
        bits = TILE_BITS
        if num_seqs >= 1 << (31 - bits):
            raise ValueError(f"a chunk tile map holds fewer than {1 << (31 - bits)} sequences")
        q_lens = np.diff(query_start_loc[: num_seqs + 1])
        seqs = np.flatnonzero(q_lens > 1)
        counts = -(-q_lens[seqs] // self.chunk_query_tile)
        total = int(counts.sum())
        if total > len(out) or (total and counts.max() >= 1 << bits):
            raise ValueError(f"{total} chunk tiles do not fit a map of {len(out)}")
        first = np.cumsum(counts) - counts
        within = np.arange(total) - np.repeat(first, counts)
        out[:total] = (np.repeat(seqs, counts) << bits) | within
        return total


def _prefill_block_m(group: int) -> int:
    """Rows of a prefill tile: 128 (query tokens x the GQA group), more for a group past it."""
    return max(next_power_of_2(group), 128)


def shared_memory_estimate(
    tiles: dict[str, int], head_dim: int, elem_bytes: int, query_elem_bytes: int | None = None
) -> int:
    """Bytes of the pipelined K and V tiles (``elem_bytes``: the cache's) plus the query tile
    (``query_elem_bytes``, None: the same), what Triton stages in smem. An FP8 cache's tiles
    are staged as stored and widened in registers: sm_90 compiles of the 8B launches ask for
    exactly this (`ember.bench.compile_check`)."""
    kv = 2 * tiles["BLOCK_N"] * head_dim * elem_bytes * tiles["KV_STAGES"]
    return kv + tiles["BLOCK_M"] * head_dim * (query_elem_bytes or elem_bytes)


def fit_shared_memory(
    tiles: dict[str, int],
    head_dim: int,
    elem_bytes: int,
    budget: int = SHARED_MEMORY_BUDGET,
    query_elem_bytes: int | None = None,
) -> dict[str, int]:
    """``tiles`` with its K/V tiles, then its pipeline depth, shrunk until they fit ``budget``."""
    return shrink_to_fit(
        tiles,
        lambda c: shared_memory_estimate(c, head_dim, elem_bytes, query_elem_bytes),
        [
            ("BLOCK_N", 64, True),
            ("KV_STAGES", 2, False),
            ("BLOCK_N", 16, True),
            ("KV_STAGES", 1, False),
        ],
        budget,
    )
