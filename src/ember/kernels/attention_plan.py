"""Planning the paged attention kernel's launches, without Triton: how many KV segments a decode
splits into, which tile configuration a launch takes, and the map of a mixed step's chunk tiles.

The runner and the CUDA graphs size their buffers and graphs from these, so they must import
without Triton (the CPU path has none); `ember.kernels.paged_attention` launches from them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ember.kernels.tiles import shrink_to_fit

# The split heuristic (measured with `ember bench tune` on an H200, 8B attention shape): while
# the programs do not fill one wave (fewer than one per SM) a decode is latency-bound and
# splitting down to one 64-key tile per segment pays (batch 1 at 512 tokens: 17.4 us unsplit,
# 13.2 in 2 segments, 7.6 in 8); once they fill a wave, a split only pays on long segments
# (batch 32: 2 splits lose 6% at 512 tokens and win 7% at 4,096).
PROGRAMS_PER_SM = 2
MIN_TOKENS_PER_SPLIT_UNDER_ONE_WAVE = 64
MIN_TOKENS_PER_SPLIT = 1024
MAX_SPLITS = 32
# Unsplit decode launches with at least this many programs per SM take one-warp programs (a
# program holds 255 registers, so 8 fit an SM; measurements in `tile_config`). Between 3.9
# per SM (slower) and 7.8 (faster) it was not measured.
ONE_WARP_MINPROGRAMS_PER_SM = 6
# A mixed step's decodes: at most this many segments each (a grid constant, see paged_attention).
MIXED_DECODE_SPLITS = 4
# Used when there is no CUDA device to ask (the CPU interpreter): an H200's SM count.
DEFAULT_NUM_SMS = 132
# A chunk tile map's entry (`chunk_tile_map`): its sequence above these bits, the tile's index
# within the sequence below.
TILE_BITS = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1), as `triton.next_power_of_2`."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """KV segments per sequence for a decode-only step.

    Split only as far as needed to give every SM ``PROGRAMS_PER_SM`` programs, and never into
    segments shorter than one KV tile while the GPU is under one wave, or than
    ``MIN_TOKENS_PER_SPLIT`` tokens once it is full.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = cdiv(PROGRAMS_PER_SM * num_sms, programs)
    by_length = cdiv(max(1, max_seq_len), min_tokens_per_split(num_seqs, num_kv_heads, num_sms))
    return max(1, min(wanted, by_length, MAX_SPLITS))


def under_one_wave(num_seqs: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a decode's unsplit programs (one per sequence and KV head) leave SMs idle."""
    return num_seqs * num_kv_heads < num_sms


def min_tokens_per_split(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """The shortest KV segment worth its own program: one tile while the ``num_seqs *
    num_kv_heads`` programs are under one wave, ``MIN_TOKENS_PER_SPLIT`` once they fill it. The
    kernel applies it per sequence too, so a grid cut for a longer bound splits no further."""
    if under_one_wave(num_seqs, num_kv_heads, num_sms):
        return MIN_TOKENS_PER_SPLIT_UNDER_ONE_WAVE
    return MIN_TOKENS_PER_SPLIT


def preloads_kv(pdl: bool, split_kv: bool, under_one_wave: bool) -> bool:
    """Whether a decode loads its first K/V tile before the PDL wait: only under PDL (there is a
    wait to hide it under), on the split path, and while the programs are under one wave (small
    batches, where the step is a chain of latencies). Held in registers by every program of
    a full wave it cost 80 us per step at batch 128, and ~1 ms at batch 32 with 4,096-token
    contexts (in-call A/Bs on an H200, bench/results/README.md "K/V before the wait" and
    "Segments per sequence")."""
    return pdl and split_kv and under_one_wave


def device_sm_count(device: torch.device) -> int:
    """The device's SM count, or an H200's (132) off CUDA: what the split heuristic sizes for."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _prefill_block_m(group: int) -> int:
    """Rows of a prefill tile: 128 (query tokens x the GQA group), more for a group past it."""
    return max(next_power_of_2(group), 128)


def prefill_query_tile(num_q_heads: int, num_kv_heads: int) -> int:
    """Query tokens a prefill-tile program serves: what `chunk_tile_map` cuts chunks by."""
    group = num_q_heads // num_kv_heads
    return _prefill_block_m(group) // group


class ChunkTiles(NamedTuple):
    """A mixed step's map of its chunks' query tiles (`chunk_tile_map`), for the launch on
    prefill tiles: one program per entry of ``tiles[:grid]`` (int32 on the device; -1 past the
    step's own tiles), each ``block_q`` query tokens."""

    tiles: torch.Tensor
    grid: int
    block_q: int


def chunk_tile_bound(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """The most chunk tiles a step of ``num_tokens`` query tokens in ``num_seqs`` sequences can
    have: a tile per ``block_q`` tokens, and a partial one per chunk."""
    return num_tokens // block_q + num_seqs


def chunk_tile_map(query_start_loc: np.ndarray, num_seqs: int, block_q: int,
                   out: np.ndarray) -> int:  # fmt: skip
    """Write into ``out`` one entry per ``block_q``-token query tile of each sequence with more
    than one query token (sequence << 16 | the tile's index within it); returns how many.

    Without a map, the chunk launch's grid has a tile for every sequence, decodes and a CUDA
    graph's padding included, and each program finds its sequence by a binary search: beside
    200 decodes in a graph of 256 sequences, 2,240 programs of which 128 had work, 43.5 us a
    layer on an H200; 21.3 with the map (bench/results/README.md, "Mixed steps: long decodes
    in segments, a chunk tile map, finer mixed graphs").
    """
    bits = TILE_BITS
    if num_seqs >= 1 << (31 - bits):
        raise ValueError(f"a chunk tile map holds fewer than {1 << (31 - bits)} sequences")
    q_lens = np.diff(query_start_loc[: num_seqs + 1])
    seqs = np.flatnonzero(q_lens > 1)
    counts = -(-q_lens[seqs] // block_q)
    total = int(counts.sum())
    if total > len(out) or (total and counts.max() >= 1 << bits):
        raise ValueError(f"{total} chunk tiles do not fit a map of {len(out)}")
    first = np.cumsum(counts) - counts
    within = np.arange(total) - np.repeat(first, counts)
    out[:total] = (np.repeat(seqs, counts) << bits) | within
    return total


def tile_config(
    group: int,
    decode_only: bool,
    head_dim: int,
    elem_bytes: int,
    split_kv: bool = False,
    programs_per_sm: float = 0.0,
) -> dict[str, int]:
    """Tile sizes from the step's kind. Rows of a program = query tokens x the GQA group.
    ``programs_per_sm``: an unsplit decode launch's programs over the SMs."""
    min_rows = max(16, next_power_of_2(group))  # tl.dot needs M >= 16
    if decode_only:
        # One query per sequence: the group's heads are the rows. On an H200 (`ember bench
        # tune`) split decodes ran best on 64-key tiles, 4 warps, 2 stages, and unsplit ones
        # on 64-key tiles, 2 warps, 3 stages (2-3% over 4 warps at batch 64-256). A decode
        # program's tile loop is bound by per-tile latency, not by loads in flight, so the SM
        # needs many programs. Past ONE_WARP_MINPROGRAMS_PER_SM, one-warp programs (no
        # cross-warp softmax reductions) on 32-key tiles ran faster: -0.21 / -0.25 ms a step at
        # batch 128 / 256, but +0.17 / +0.10 at 32 / 64, where they left the SMs short of warps
        # (bench/results/README.md, "One-warp decode programs").
        if split_kv:
            block_n, warps, stages = 64, 4, 2
        elif programs_per_sm >= ONE_WARP_MINPROGRAMS_PER_SM:
            block_n, warps, stages = 32, 1, 3
        else:
            block_n, warps, stages = 64, 2, 3
        config = {"BLOCK_M": min_rows, "BLOCK_Q": 1, "BLOCK_N": block_n, "num_warps": warps,
                  "KV_STAGES": stages}  # fmt: skip
    else:
        # Prefill is compute-bound: 128x128 tiles on 8 warps ran ~10% faster than 128x64 on an
        # H200 (2k/8k-token chunks at 229/347 TFLOP/s). One configuration for every mixed step,
        # whatever its longest chunk, so a step gives the same numbers eagerly and padded in a
        # CUDA graph.
        block_m = _prefill_block_m(group)
        config = {
            "BLOCK_M": block_m,
            "BLOCK_Q": block_m // group,
            "BLOCK_N": 128,
            "num_warps": 8,
            "KV_STAGES": 2,
        }
    return _fit_shared_memory(config, head_dim, elem_bytes)


def shared_memory_estimate(config: dict[str, int], head_dim: int, elem_bytes: int) -> int:
    """Bytes of the pipelined K and V tiles plus the query tile (what Triton stages in smem)."""
    kv = 2 * config["BLOCK_N"] * head_dim * elem_bytes * config["KV_STAGES"]
    return kv + config["BLOCK_M"] * head_dim * elem_bytes


def _fit_shared_memory(config: dict[str, int], head_dim: int, elem_bytes: int) -> dict[str, int]:
    """Shrink the K/V tiles (then the pipeline depth) of wide heads or fp32 caches until they fit:
    fp32 with 128x128 tiles asks for 256 KiB and fails to launch on an H200."""
    return shrink_to_fit(
        config,
        lambda c: shared_memory_estimate(c, head_dim, elem_bytes),
        [("BLOCK_N", 64, True), ("KV_STAGES", 2, False), ("BLOCK_N", 16, True),
         ("KV_STAGES", 1, False)],
    )  # fmt: skip
