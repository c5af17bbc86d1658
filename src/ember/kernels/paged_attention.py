"""Paged attention over the block-table KV cache for one step (prefill chunks + decodes).

One launch covers every sequence of the step. A program owns one KV head and one tile of query
tokens of one sequence; its rows are (query token, query head of the GQA group) pairs, so the K/V
tiles it streams are read once for all the group's query heads. Scores go through tensor cores
(``tl.dot``), softmax is online in fp32 in the log2 domain.

A mixed step launches the kernel twice: its single-token sequences (decodes) on decode tiles,
its chunks on prefill tiles, each launch skipping the other's sequences on the GPU (so the plan
holds in a CUDA graph whatever the step's mix). The chunks' launch can run over a host-built map
of their query tiles instead of a tile per sequence. What each launch does (tiles, segments) is
decided on the host by `ember.kernels.attention_plan.AttentionPlanner`; this module launches.

Decode-only steps (every ``q_len == 1``) can also take the split-KV ("flash-decoding") path, and
a mixed step's long decodes take it with a few segments: each sequence's KV range is cut into
segments handled by separate programs that write partial (max, sum, acc) triples, merged by the
last program of each (sequence, KV head) to finish (it counts arrivals in the caller's counters,
or in zeros allocated per call). That is what fills the GPU when ``num_seqs * num_kv_heads``
programs would leave SMs idle (small batch, long context).

An FP8 cache (float8 e4m3, docs/CONTRACTS.md "FP8 KV cache") is read as stored, widened to the
queries' dtype for the dots: k_scale is folded into the softmax scale on the host and v_scale
multiplies the accumulated output once (`ember.kernels.kv_fp8`).

A layer with a sliding window or chunks (``KEY_START``) starts each program's tile loop at the
tile of its first query's first visible key, so a decode reads (and split-KV cuts) only its
window; attention sinks join each row's denominator once, where it is normalised (the unsplit
store or the split merge). docs/CONTRACTS.md, "Windows, sinks, chunks".

Layouts and metadata follow docs/CONTRACTS.md ("Paged KV cache layout", "Attention metadata").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ember.kernels.attention_plan import (
    TILE_BITS,
    AttentionLaunch,
    ChunkTiles,
    KeyStart,
    Sequences,
    cdiv,
    key_start,
    next_power_of_2,
)
from ember.kernels.compile_ahead import launch
from ember.kernels.fp8_widen import fp8_in_registers, widen_e4m3
from ember.kernels.head_norm import head_inv_rms, qk_norm_args, rms_norm_heads
from ember.kernels.kv_fp8 import is_fp8_cache, kv_scale_args, to_cache
from ember.kernels.pdl import wait_for_producer
from ember.kernels.row_norm import (
    check_row_norm,
    inv_rms_of,
    load_row_parts,
    row_norm_args,
    scale_and_round,
)
from ember.layers.qk_norm import QkNorm, check_qk_norms
from ember.layers.row_norm import RowNorm

_LOG2E = 1.4426950408889634
_LOG2E_IN_KERNEL = tl.constexpr(_LOG2E)  # a sink's logit into the scores' log2 domain

# Splits merged per unrolled chunk by the in-kernel merge (its loads stay in registers).
_MAX_MERGE_CHUNK = 8
# Which sequences a launch serves (the kernel's SEQUENCES): all of them, or, in a mixed step's
# two launches, those of one query token (decode tiles) or those of more (prefill tiles).
_ALL_SEQUENCES = tl.constexpr(Sequences.ALL.value)
_SINGLE_TOKEN = tl.constexpr(Sequences.SINGLE_TOKEN.value)
_MULTI_TOKEN = tl.constexpr(Sequences.MULTI_TOKEN.value)
# Where a query's keys start (`KeyStart`, the kernel's KEY_START).
_CAUSAL = tl.constexpr(KeyStart.CAUSAL.value)
_WINDOW = tl.constexpr(KeyStart.WINDOW.value)
_CHUNK = tl.constexpr(KeyStart.CHUNK.value)
# A chunk tile map's entry (`AttentionPlanner.chunk_tile_map`): its sequence above these bits,
# the tile's index within the sequence below.
_TILE_BITS = tl.constexpr(TILE_BITS)
_TILE_MASK = tl.constexpr((1 << _TILE_BITS.value) - 1)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q: tl.constexpr):
    """Sequence owning query tile ``tile_id``: sequence s owns tiles from qsl[s] // BLOCK_Q + s.

    The ``+ s`` leaves room for each sequence's partial last tile, so tile starts are increasing
    and a binary search over ``query_start_loc`` finds the owner without a host-side tile map.
    """
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        is_at_or_before = mid_start <= tile_id
        lo = tl.where(is_at_or_before, mid, lo)
        hi = tl.where(is_at_or_before, hi, mid)
    return lo


@triton.jit
def _left_to_other_launch(q_len, SEQUENCES: tl.constexpr):
    """Whether a launch serving ``SEQUENCES`` leaves a sequence of ``q_len`` query tokens to the
    mixed step's other launch (single-token sequences on decode tiles, longer ones not)."""
    if SEQUENCES == _SINGLE_TOKEN:
        return q_len != 1
    elif SEQUENCES == _MULTI_TOKEN:
        return q_len == 1
    else:
        return q_len < 0  # every sequence: none left


@triton.jit
def _kv_tile_offsets(
    table_row_ptr,
    kv_head_offset,
    kv_pos,
    kv_in_range,
    stride_cache_block,
    stride_cache_slot,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Cache offsets of the K/V rows at positions ``kv_pos`` (one KV head), through the table."""
    dims = tl.arange(0, HEAD_DIM)
    if MASKED:
        block_ids = tl.load(table_row_ptr + kv_pos // PAGE, mask=kv_in_range, other=0)
    else:
        block_ids = tl.load(table_row_ptr + kv_pos // PAGE)
    # int64: block id * block stride overflows int32 on large caches.
    slot_offsets = (
        block_ids.to(tl.int64) * stride_cache_block
        + (kv_pos % PAGE) * stride_cache_slot
        + kv_head_offset
    )
    return slot_offsets[:, None] + dims[None, :]


@triton.jit
def _widened(tile, dtype: tl.constexpr, KV_FP8: tl.constexpr):
    """A K or V tile as the dots take it, in ``dtype``: an FP8 cache's widened by Triton's
    conversions (``KV_FP8`` 1) or in PTX (2, `ember.kernels.fp8_widen`)."""
    if KV_FP8:
        return widen_e4m3(tile, dtype, KV_FP8 == 2)
    return tile.to(dtype)


@triton.jit
def _softmax_step(
    q,
    k,
    m_i,
    l_i,
    kv_pos,
    row_pos,
    row_lo,
    qk_scale,
    MASKED: tl.constexpr,
    LOCAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Scores of one K tile and the online-softmax update: (new max, new sum, p, rescale). An
    FP8 tile widens to the queries' dtype (`_widened`; its k_scale is in ``qk_scale``).
    ``LOCAL``: each row sees keys from ``row_lo`` on only (a window's or chunk's start), and a
    masked tile may hold none of a row's keys."""
    k = _widened(k, q.dtype, KV_FP8)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        # Causal; also hides positions past the sequence since row_pos < seq_len.
        visible = kv_pos[None, :] <= row_pos[:, None]
        if LOCAL:
            visible = visible & (kv_pos[None, :] >= row_lo[:, None])
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = m_new
    if LOCAL:  # a row that has seen no key yet keeps zero sums (not exp2(-inf + inf))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _attend_kv_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    kv_head_offset,
    kv_start,
    kv_end,
    row_pos,
    row_lo,
    qk_scale,
    stride_cache_block,
    stride_cache_slot,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    LOCAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One online-softmax step over KV positions [kv_start, kv_start + BLOCK_N)."""
    kv_pos = kv_start + tl.arange(0, BLOCK_N)
    kv_in_range = kv_pos < kv_end
    kv_offsets = _kv_tile_offsets(
        table_row_ptr,
        kv_head_offset,
        kv_pos,
        kv_in_range,
        stride_cache_block,
        stride_cache_slot,
        PAGE,
        HEAD_DIM,
        MASKED,
    )
    if MASKED:
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_in_range[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_offsets)
    m_new, l_i, p, alpha = _softmax_step(
        q, k, m_i, l_i, kv_pos, row_pos, row_lo, qk_scale, MASKED, LOCAL, DOT_PRECISION, KV_FP8
    )
    if MASKED:
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_in_range[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + kv_offsets)
    return m_new, l_i, _accumulate_values(acc, alpha, p, v, q.dtype, DOT_PRECISION, KV_FP8)


@triton.jit
def _accumulate_values(
    acc, alpha, p, v, dot_ty: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr
):
    """``acc`` rescaled by ``alpha`` plus ``p @ v``, both in ``dot_ty`` (the queries' dtype: an
    FP8 tile widens to it, `_widened`; its v_scale is applied to the finished ``acc``)."""
    v = _widened(v, dot_ty, KV_FP8)
    return acc * alpha[:, None] + tl.dot(p.to(dot_ty), v, input_precision=DOT_PRECISION)


@triton.jit
def _rope_factors(positions_ptr, cos_sin_ptr, tok, tok_valid, HEAD_DIM: tl.constexpr):
    """Token ``tok``'s RoPE factors (neox "rotate_half"): each dim pairs with the one half a head
    away, and the sine's sign folds in the minus of the first half. Returns (cos, signed sin,
    partner); ``tok_valid`` false (a padding sequence's tile) reads position 0."""
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HEAD_DIM)
    partner = (dims + half) % HEAD_DIM
    table = cos_sin_ptr + tl.load(positions_ptr + tok, mask=tok_valid, other=0) * HEAD_DIM
    cos = tl.load(table + dims % half)
    signed_sin = tl.load(table + half + dims % half) * tl.where(dims < half, -1.0, 1.0)
    return cos, signed_sin, partner


@triton.jit
def _rms_normalize_heads(x, eps, dtype: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Llama 4's QK norm of fp32 heads ``x`` (rows, or one head) as rounded to ``dtype``:
    each times ``1/sqrt(mean square + eps)``, as `rope_and_cache_write` normalises them."""
    x = x.to(dtype).to(tl.float32)
    mean_square = tl.sum(x * x, axis=-1, keep_dims=True) / HEAD_DIM
    return x * tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_square + eps))


@triton.jit
def _rotate_query(
    q,
    q_rows,
    row_valid,
    cos,
    signed_sin,
    partner,
    scale,
    q_norm_ptr,
    rms_eps,
    l2_eps,
    SCALED: tl.constexpr,
    ROTATE: tl.constexpr,
    QK_RMS_NORM: tl.constexpr,
    QK_L2_NORM: tl.constexpr,
):
    """Rotate one token's query rows (fp32, cast back like the RoPE kernel; scaled by ``scale``
    first when ``SCALED``, as `rope_and_cache_write` does; RMS-normalised with ``q_norm_ptr``'s
    weight before the rotation when ``QK_RMS_NORM``; a NoPE layer's not ``ROTATE``; each head
    normalised after when ``QK_L2_NORM``)."""
    head_dim: tl.constexpr = q.shape[1]
    q_own = scale_and_round(q, scale, q.dtype, SCALED)
    if QK_RMS_NORM:  # each row is a whole head: its partners share its 1/rms
        inv_rms = head_inv_rms(tl.sum(q_own * q_own, 1, keep_dims=True), rms_eps, head_dim)
        q_own = rms_norm_heads(q_own, inv_rms, q_norm_ptr, tl.arange(0, head_dim), q.dtype)
    if ROTATE:
        q_partner = tl.load(q_rows + partner[None, :], mask=row_valid[:, None], other=0.0)
        q_partner = scale_and_round(q_partner, scale, q.dtype, SCALED)
        if QK_RMS_NORM:
            q_partner = rms_norm_heads(q_partner, inv_rms, q_norm_ptr, partner, q.dtype)
        rotated = q_own * cos[None, :] + q_partner * signed_sin[None, :]
    else:
        rotated = q_own
    if QK_L2_NORM:
        rotated = _rms_normalize_heads(rotated, l2_eps, q.dtype, head_dim)
    return rotated.to(q.dtype)


@triton.jit
def _write_new_key_value(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot,
    head_offset,
    cos,
    signed_sin,
    partner,
    scale,
    k_norm_ptr,
    rms_eps,
    l2_eps,
    k_scale,
    v_scale,
    stride_cache_block,
    stride_cache_slot,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SCALED: tl.constexpr,
    KV_FP8: tl.constexpr,
    ROTATE: tl.constexpr,
    QK_RMS_NORM: tl.constexpr,
    QK_L2_NORM: tl.constexpr,
):
    """Rotate one KV head of the new token's key and store it and its value at ``slot`` (-1:
    padding, nothing stored); both scaled by ``scale`` first when ``SCALED``, and quantized by
    ``k_scale``, ``v_scale`` for an FP8 cache. The barrier makes the stores visible to the whole
    program before it reads the tile that holds them. Returns the stored key and value, as the
    cache holds them (a tile loaded before the store takes them from here, and reads them as it
    reads every stored entry). A NoPE layer's key (not ``ROTATE``) is stored unrotated;
    ``QK_RMS_NORM`` normalises it with ``k_norm_ptr``'s weight before the rotation,
    ``QK_L2_NORM`` after it."""
    dims = tl.arange(0, HEAD_DIM)
    dtype = k_ptr.dtype.element_ty
    k = scale_and_round(tl.load(k_ptr + dims), scale, dtype, SCALED)
    if QK_RMS_NORM:
        inv_rms = head_inv_rms(tl.sum(k * k, 0), rms_eps, HEAD_DIM)
        k = rms_norm_heads(k, inv_rms, k_norm_ptr, dims, dtype)
    if ROTATE:
        k_partner = scale_and_round(tl.load(k_ptr + partner), scale, dtype, SCALED)
        if QK_RMS_NORM:
            k_partner = rms_norm_heads(k_partner, inv_rms, k_norm_ptr, partner, dtype)
        rotated = k * cos + k_partner * signed_sin
    else:
        rotated = k
    if QK_L2_NORM:
        rotated = _rms_normalize_heads(rotated, l2_eps, dtype, HEAD_DIM)
    cache = (slot // PAGE) * stride_cache_block + (slot % PAGE) * stride_cache_slot + head_offset
    keep = (dims < HEAD_DIM) & (slot >= 0)
    v = scale_and_round(tl.load(v_ptr + dims), scale, dtype, SCALED)
    stored_k = to_cache(rotated, k_scale, dtype, k_cache_ptr.dtype.element_ty, KV_FP8)
    stored_v = to_cache(v, v_scale, dtype, v_cache_ptr.dtype.element_ty, KV_FP8)
    tl.store(k_cache_ptr + cache + dims, stored_k, mask=keep)
    tl.store(v_cache_ptr + cache + dims, stored_v, mask=keep)
    tl.debug_barrier()
    return stored_k, stored_v


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    split_counters_ptr,
    rope_k_ptr,
    rope_v_ptr,
    positions_ptr,
    cos_sin_ptr,
    slot_mapping_ptr,
    chunk_tiles_ptr,
    sinks_ptr,
    q_norm_ptr,
    k_norm_ptr,
    parts_ptr,
    num_parts,
    hidden,
    eps,
    rms_eps,
    l2_eps,
    key_span,
    qk_scale,
    k_scale,
    v_scale,
    num_seqs,
    num_splits,
    min_split_tiles,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    stride_rk_tok,
    stride_rk_head,
    stride_rv_tok,
    stride_rv_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_STAGES: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    GROUP_P2: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    ROPE: tl.constexpr,
    ROW_NORM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
    PRELOAD_KV: tl.constexpr,
    SEQUENCES: tl.constexpr,
    TILE_MAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    KEY_START: tl.constexpr,
    SINKS: tl.constexpr,
    ROTATE: tl.constexpr,
    QK_RMS_NORM: tl.constexpr,
    QK_L2_NORM: tl.constexpr,
):
    # Until the wait, a program reads only what no kernel of this step writes: the step's
    # metadata and the cache's keys of earlier steps. Under PDL that runs under the previous
    # kernel's tail (`ember.kernels.pdl`).
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    no_tile = False
    if DECODE_ONLY:
        seq = tile_id
        local_tile = 0
    elif TILE_MAP:
        # The host's map of the chunks' tiles (`AttentionPlanner.chunk_tile_map`); -1: a spare
        # program.
        entry = tl.load(chunk_tiles_ptr + tile_id)
        no_tile = entry < 0
        seq = tl.where(no_tile, 0, entry >> _TILE_BITS)
        local_tile = tl.where(no_tile, 0, entry & _TILE_MASK)
    else:
        seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q)
        local_tile = tile_id - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    seq_q_start = tl.load(query_start_loc_ptr + seq)
    seq_q_end = tl.load(query_start_loc_ptr + seq + 1)
    tile_q_start = seq_q_start + local_tile * BLOCK_Q
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - (seq_q_end - seq_q_start)

    # Row r is query token r // GROUP of the tile, query head r % GROUP of this KV head's group.
    rows = tl.arange(0, BLOCK_M)
    row_q = rows // GROUP
    row_head = kv_head * GROUP + rows % GROUP
    row_tok = tile_q_start + row_q
    row_valid = (row_q < BLOCK_Q) & (row_tok < seq_q_end)
    first_pos = context_len + local_tile * BLOCK_Q
    # Padding rows borrow the tile's first position so their softmax stays finite.
    row_pos = tl.where(row_valid, context_len + (row_tok - seq_q_start), first_pos)

    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # one past the tile's last visible key
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
    # Tiles below the tile's first query position are visible to every row: no mask needed.
    num_full_tiles = (first_pos + 1) // BLOCK_N
    # A window or chunk starts each row's keys at row_lo: the tiles from the first row's start
    # (first_tile) up to the last row's (num_low_tiles) are masked, those below never read.
    LOCAL: tl.constexpr = KEY_START != _CAUSAL
    row_lo = row_pos
    first_tile = 0
    num_low_tiles = 0
    if LOCAL:
        row_lo = _first_visible_key(row_pos, key_span, KEY_START)
        first_tile = _first_visible_key(first_pos, key_span, KEY_START) // BLOCK_N
        last_lo = _first_visible_key(kv_end - 1, key_span, KEY_START)
        num_low_tiles = tl.minimum(
            tl.maximum(tl.cdiv(last_lo, BLOCK_N), first_tile), num_full_tiles
        )
    if SPLIT_KV:
        # Segments are cut from this sequence's own key range, none under min_split_tiles: a
        # grid sized for the longest sequence the step may hold (a CUDA graph's bound) leaves a
        # shorter one's (or a window's) surplus programs idle instead of merging empty partials.
        range_tiles = num_kv_tiles - first_tile
        tiles_per_split = tl.maximum(tl.cdiv(range_tiles, num_splits), min_split_tiles)
        seq_splits = tl.cdiv(range_tiles, tiles_per_split)
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(num_kv_tiles, tile_lo + tiles_per_split)
    else:
        seq_splits = 1
        tile_lo = first_tile
        tile_hi = num_kv_tiles
    table_row_ptr = block_tables_ptr + seq * stride_table
    kv_head_offset = kv_head * stride_cache_head

    # A decode that writes its own new key (ROPE, decode-only) reads its token's RoPE factors and
    # cache slot before the wait. PRELOAD_KV (ROPE only) loads its segment's first K/V tile there
    # too; the new key's row, if the tile holds it, comes from registers once rotated.
    if ROPE:
        tile_valid = tile_q_start < seq_q_end
        if ROTATE:
            cos, signed_sin, partner = _rope_factors(
                positions_ptr, cos_sin_ptr, tile_q_start, tile_valid, HEAD_DIM
            )
        else:  # a NoPE layer's new key is stored as it is
            cos = tl.zeros([HEAD_DIM], dtype=tl.float32)
            signed_sin = cos
            partner = tl.arange(0, HEAD_DIM)
        slot = tl.load(slot_mapping_ptr + tile_q_start, mask=tile_valid, other=-1)
    if PRELOAD_KV:
        pre_pos = tile_lo * BLOCK_N + tl.arange(0, BLOCK_N)
        pre_in_range = (pre_pos < kv_end) & (tile_lo < tile_hi)
        pre_offsets = _kv_tile_offsets(
            table_row_ptr,
            kv_head_offset,
            pre_pos,
            pre_in_range,
            stride_cache_block,
            stride_cache_slot,
            PAGE,
            HEAD_DIM,
            True,
        )
        pre_k = tl.load(k_cache_ptr + pre_offsets, mask=pre_in_range[:, None], other=0.0)
        pre_v = tl.load(v_cache_ptr + pre_offsets, mask=pre_in_range[:, None], other=0.0)
        tile_lo_loop = tile_lo + 1
    else:
        tile_lo_loop = tile_lo

    wait_for_producer(PDL)
    # A spare tile or segment, an empty (padding) sequence, or one the other launch of a mixed
    # step serves (`_left_to_other_launch`). Every program exits after the wait, so a mixed
    # step's second launch waits for its first: the next kernel's PDL wait covers both.
    if (
        (tile_q_start >= seq_q_end)
        | (split >= seq_splits)
        | no_tile
        | _left_to_other_launch(seq_q_end - seq_q_start, SEQUENCES)
    ):
        return

    if ROPE and ROW_NORM:  # issued first: the row's statistics gate every use of q, k and v
        row_parts = load_row_parts(parts_ptr, tile_q_start, num_parts, BLOCK_P)
    dims = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + row_tok[:, None] * stride_q_tok + row_head[:, None] * stride_q_head
    q = tl.load(q_rows + dims[None, :], mask=row_valid[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if ROPE:
        # A decode step's RoPE and KV-cache write, done here instead of by their own kernel: the
        # query is rotated in registers, and the program whose segment holds the new key (the
        # last tile) rotates and stores it, with the value, before reading that tile. A deferred
        # RMSNorm scales the token's q, k and v first.
        scale = 1.0
        if ROW_NORM:
            scale = inv_rms_of(row_parts, hidden, eps)
        q = _rotate_query(
            q,
            q_rows,
            row_valid,
            cos,
            signed_sin,
            partner,
            scale,
            q_norm_ptr,
            rms_eps,
            l2_eps,
            ROW_NORM,
            ROTATE,
            QK_RMS_NORM,
            QK_L2_NORM,
        )
        if (num_kv_tiles - 1 >= tile_lo) & (num_kv_tiles - 1 < tile_hi):
            new_k, new_v = _write_new_key_value(
                rope_k_ptr + tile_q_start * stride_rk_tok + kv_head * stride_rk_head,
                rope_v_ptr + tile_q_start * stride_rv_tok + kv_head * stride_rv_head,
                k_cache_ptr,
                v_cache_ptr,
                slot,
                kv_head * stride_cache_head,
                cos,
                signed_sin,
                partner,
                scale,
                k_norm_ptr,
                rms_eps,
                l2_eps,
                k_scale,
                v_scale,
                stride_cache_block,
                stride_cache_slot,
                PAGE,
                HEAD_DIM,
                ROW_NORM,
                KV_FP8,
                ROTATE,
                QK_RMS_NORM,
                QK_L2_NORM,
            )
            if PRELOAD_KV:
                # A padding token (slot -1) stores nothing: its tile keeps what the cache holds.
                is_new = ((pre_pos == first_pos) & (slot >= 0))[:, None]
                pre_k = tl.where(is_new, new_k[None, :], pre_k)
                pre_v = tl.where(is_new, new_v[None, :], pre_v)
        if PRELOAD_KV and tile_lo < tile_hi:
            m_i, l_i, p, alpha = _softmax_step(
                q,
                pre_k,
                m_i,
                l_i,
                pre_pos,
                row_pos,
                row_lo,
                qk_scale,
                True,
                LOCAL,
                DOT_PRECISION,
                KV_FP8,
            )
            acc = _accumulate_values(acc, alpha, p, pre_v, q.dtype, DOT_PRECISION, KV_FP8)

    # Loop-level pipelining also prefetches the block-table loads the K/V addresses depend on.
    unmasked_lo = tile_lo_loop
    if LOCAL:
        unmasked_lo = tl.maximum(tile_lo_loop, num_low_tiles)
        for kv_tile in tl.range(
            tile_lo_loop, tl.minimum(tile_hi, num_low_tiles), num_stages=KV_STAGES
        ):
            m_i, l_i, acc = _attend_kv_tile(
                q,
                m_i,
                l_i,
                acc,
                k_cache_ptr,
                v_cache_ptr,
                table_row_ptr,
                kv_head_offset,
                kv_tile * BLOCK_N,
                kv_end,
                row_pos,
                row_lo,
                qk_scale,
                stride_cache_block,
                stride_cache_slot,
                PAGE,
                BLOCK_N,
                HEAD_DIM,
                True,
                LOCAL,
                DOT_PRECISION,
                KV_FP8,
            )
    for kv_tile in tl.range(unmasked_lo, tl.minimum(tile_hi, num_full_tiles), num_stages=KV_STAGES):
        m_i, l_i, acc = _attend_kv_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            table_row_ptr,
            kv_head_offset,
            kv_tile * BLOCK_N,
            kv_end,
            row_pos,
            row_lo,
            qk_scale,
            stride_cache_block,
            stride_cache_slot,
            PAGE,
            BLOCK_N,
            HEAD_DIM,
            False,
            False,  # every row sees every key of these tiles
            DOT_PRECISION,
            KV_FP8,
        )
    for kv_tile in tl.range(tl.maximum(unmasked_lo, num_full_tiles), tile_hi, num_stages=KV_STAGES):
        m_i, l_i, acc = _attend_kv_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            table_row_ptr,
            kv_head_offset,
            kv_tile * BLOCK_N,
            kv_end,
            row_pos,
            row_lo,
            qk_scale,
            stride_cache_block,
            stride_cache_slot,
            PAGE,
            BLOCK_N,
            HEAD_DIM,
            True,
            LOCAL,
            DOT_PRECISION,
            KV_FP8,
        )

    if KV_FP8:  # the values were read as stored; merging partials is linear, so scale them here
        acc = acc * v_scale
    sink = m_i  # unused without SINKS
    if SINKS:  # the head's sink logit, in the scores' log2 domain
        sink = tl.load(sinks_ptr + row_head).to(tl.float32) * _LOG2E_IN_KERNEL
    out_rows = out_ptr + row_tok[:, None] * stride_o_tok + row_head[:, None] * stride_o_head
    if SPLIT_KV:
        if seq_splits > 1:
            _store_partials_and_merge_last(
                out_ptr + tile_q_start * stride_o_tok,
                stride_o_head,
                m_i,
                l_i,
                acc,
                seq,
                split,
                seq_splits,
                num_splits,
                kv_head,
                row_head,
                row_valid,
                part_max_ptr,
                part_sum_ptr,
                part_acc_ptr,
                split_counters_ptr,
                sinks_ptr,
                GROUP,
                GROUP_P2,
                HEAD_DIM,
                BLOCK_SPLITS,
                MERGE_CHUNK,
                SINKS,
            )
        else:  # one segment covers this sequence: nothing to merge
            _store_rows(out_rows + dims[None, :], acc, l_i, m_i, sink, row_valid, SINKS)
    else:
        _store_rows(out_rows + dims[None, :], acc, l_i, m_i, sink, row_valid, SINKS)


@triton.jit
def _first_visible_key(pos, key_span, KEY_START: tl.constexpr):
    """The lowest key position a query at ``pos`` sees (`KeyStart`): its window's first (a
    window of ``key_span`` keys) or its chunk's (chunks of ``key_span``)."""
    if KEY_START == _WINDOW:
        return tl.maximum(pos - key_span + 1, 0)
    elif KEY_START == _CHUNK:
        return pos // key_span * key_span
    else:
        return pos * 0


@triton.jit
def _normalized(acc, total, row_max, sink, SINKS: tl.constexpr):
    """``acc / total``, both relative to ``row_max`` (log2 domain); with ``SINKS`` the row's
    sink logit joins the denominator as a key of value zero (rescaled to the larger of the two
    maxima, so a large sink cannot overflow)."""
    if SINKS:
        top = tl.maximum(row_max, sink)
        keep = tl.exp2(row_max - top)
        return acc * (keep / (total * keep + tl.exp2(sink - top)))[:, None]
    return acc / total[:, None]


@triton.jit
def _store_rows(out_ptrs, acc, l_i, m_i, sink, row_valid, SINKS: tl.constexpr):
    out = _normalized(acc, l_i, m_i, sink, SINKS)
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _store_partials_and_merge_last(
    tok_out_ptr,
    stride_o_head,
    m_i,
    l_i,
    acc,
    seq,
    split,
    seq_splits,
    num_splits,
    kv_head,
    row_head,
    row_valid,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    split_counters_ptr,
    sinks_ptr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Store a decode segment's partials, indexed [seq, q_head, split] (the grid's ``num_splits``
    is their stride), and count its arrival: the last of the sequence's ``seq_splits`` segments
    to finish for this KV head merges them into the token's output row ``tok_out_ptr`` (a reduce
    kernel would cost a launch per layer). The barrier puts every thread's partials before the
    counter's release; the acquire makes the others' partials visible to the merging program."""
    dims = tl.arange(0, HEAD_DIM)
    kv_heads = tl.num_programs(1)
    part_row = (seq * (kv_heads * GROUP) + row_head) * num_splits + split
    tl.store(part_max_ptr + part_row, m_i, mask=row_valid)
    tl.store(part_sum_ptr + part_row, l_i, mask=row_valid)
    tl.store(
        part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None]
    )
    tl.debug_barrier()
    counter = split_counters_ptr + seq * kv_heads + kv_head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == seq_splits - 1:
        tl.store(counter, 0)  # zero again for the next launch (and graph replay)
        tl.debug_barrier()
        # A decode program's rows are its group's query heads (BLOCK_Q is 1), in row order.
        heads = kv_head * GROUP + tl.arange(0, GROUP_P2)
        heads_valid = tl.arange(0, GROUP_P2) < GROUP
        sink = tl.zeros([GROUP_P2], dtype=tl.float32)  # unused without SINKS
        if SINKS:
            sink = (
                tl.load(sinks_ptr + heads, mask=heads_valid, other=0.0).to(tl.float32)
                * _LOG2E_IN_KERNEL
            )
        _merge_split_partials(
            tok_out_ptr + heads[:, None] * stride_o_head + dims[None, :],
            part_max_ptr,
            part_sum_ptr,
            part_acc_ptr,
            (seq * (kv_heads * GROUP) + heads) * num_splits,
            heads_valid,
            seq_splits,
            sink,
            GROUP_P2,
            HEAD_DIM,
            BLOCK_SPLITS,
            MERGE_CHUNK,
            SINKS,
        )


@triton.jit
def _merge_split_partials(
    out_ptrs,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    first_row,
    row_valid,
    num_splits,
    sink,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Merge the split partials of ``ROWS`` query heads: rescale each split to the global max.
    With ``SINKS`` each head's ``sink`` (log2 domain) joins the merged denominator, once.

    ``first_row[r]`` indexes row r's first split. Every load is independent of the others (the
    chunks are unrolled), so the merge costs about two L2 round trips, not one per split. ``.cg``
    loads skip L1, which must not be trusted with other SMs' writes.
    """
    splits = tl.arange(0, BLOCK_SPLITS)
    mask = row_valid[:, None] & (splits < num_splits)[None, :]
    offsets = first_row[:, None] + splits[None, :]
    part_max = tl.load(part_max_ptr + offsets, mask=mask, other=float("-inf"), cache_modifier=".cg")
    part_sum = tl.load(part_sum_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    row_max = tl.where(row_valid, tl.max(part_max, 1), 0.0)  # padding rows stay finite
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for chunk in tl.static_range(0, BLOCK_SPLITS, CHUNK):
        chunk_splits = chunk + tl.arange(0, CHUNK)
        chunk_mask = row_valid[:, None] & (chunk_splits < num_splits)[None, :]
        chunk_rows = first_row[:, None] + chunk_splits[None, :]
        chunk_max = tl.load(
            part_max_ptr + chunk_rows, mask=chunk_mask, other=float("-inf"), cache_modifier=".cg"
        )
        weight = tl.exp2(chunk_max - row_max[:, None])  # empty splits have max -inf: weight 0
        part = tl.load(
            part_acc_ptr + chunk_rows[:, :, None] * HEAD_DIM + dims[None, None, :],
            mask=chunk_mask[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += tl.sum(part * weight[:, :, None], 1)
    denominator = tl.sum(part_sum * tl.exp2(part_max - row_max[:, None]), 1)
    out = _normalized(acc, tl.where(row_valid, denominator, 1.0), row_max, sink, SINKS)
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=row_valid[:, None])


class DecodeRope(NamedTuple):
    """A decode step's RoPE + KV-cache write, for the attention kernel to do itself (a launch
    less per layer): ``k``, ``v`` are ``[T, Hkv, D]`` (views of the fused qkv output, k not yet
    rotated), the rest as `rope_and_cache_write` takes them. ``q`` is rotated in registers only:
    the q passed to attention is left as it was. ``row_norm``: a deferred RMSNorm whose ``1/rms``
    scales each token's q, k and v first (`ember.layers.row_norm`). ``rotate`` False: a NoPE
    layer (q and k are not rotated, the key is stored as it is); ``qk_norm``: each head of q and
    k RMS-normalised with its weights before the rotation (Qwen3's; in registers too, the q and
    k passed stay unnormalised); ``qk_l2_norm_eps``: each head of q and k normalised after the
    rotation (Llama 4's QK norm); not both."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    row_norm: RowNorm | None = None
    rotate: bool = True
    qk_l2_norm_eps: float | None = None
    qk_norm: QkNorm | None = None


def _check_decode_rope(rope: DecodeRope, q: torch.Tensor, k_cache: torch.Tensor, decode: bool):
    if not decode:
        raise ValueError("RoPE in the attention kernel serves decode-only steps (max_query_len 1)")
    num_tokens, _, head_dim = q.shape
    expected = (num_tokens, k_cache.shape[2], head_dim)
    if tuple(rope.k.shape) != expected or tuple(rope.v.shape) != expected:
        raise ValueError(
            f"rope k and v must be {expected}, got {tuple(rope.k.shape)}, {tuple(rope.v.shape)}"
        )
    if rope.k.stride(2) != 1 or rope.v.stride(2) != 1:
        raise ValueError("rope k and v must have a contiguous head_dim")
    if rope.cos_sin_cache.dtype != torch.float32 or not rope.cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous float32")
    check_row_norm(rope.row_norm, num_tokens)
    check_qk_norms(rope.qk_norm, rope.qk_l2_norm_eps)


def _kv_fp8_mode(k_cache: torch.Tensor, widen_in_registers: bool) -> int:
    """The kernel's ``KV_FP8``: 0 a cache of the queries' kind, 1 FP8 widened by Triton's
    conversions, 2 FP8 widened in PTX."""
    if not is_fp8_cache(k_cache):
        return 0
    return 2 if fp8_in_registers(widen_in_registers) else 1


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    launches: tuple[AttentionLaunch, ...],
    *,
    split_counters: torch.Tensor | None = None,
    rope: DecodeRope | None = None,
    pdl: bool = False,
    chunk_tiles: ChunkTiles | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    fp8_widen_in_registers: bool = False,
) -> torch.Tensor:
    """Causal attention of this step's queries over the paged KV cache; writes and returns ``out``.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]`` (last dim contiguous; may be a view of a
            fused qkv buffer).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding
            this step's keys/values (unless ``rope`` writes them).
        query_start_loc, seq_lens, block_tables: step metadata as in docs/CONTRACTS.md.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: ``[num_tokens, num_q_heads, head_dim]``; rows outside ``[0, query_start_loc[-1])``
            are left untouched.
        launches: the step's launches, as `AttentionPlanner.plan` decides them.
        split_counters: int32 zeros, at least ``num_seqs * num_kv_heads``, kept by the caller
            across calls: the split path's arrival counters (the last program of each sequence
            and KV head to finish merges the partials and zeroes its counter again). None: zeros
            allocated per call (a memset launch more).
        rope: apply this decode step's RoPE and write its keys and values to the cache in the
            kernel (decode-only steps; see `DecodeRope`).
        pdl: launch with programmatic dependent launch (`ember.kernels.pdl`).
        chunk_tiles: the step's chunk tile map, for a launch with ``chunk_map``: one program per
            mapped tile instead of one per sequence searching for its tiles.
        kv_scales: an FP8 cache's (k_scale, v_scale): its entries read as ``stored * scale``,
            and ``rope`` stores ``x / scale``. Ignored by a cache of any other dtype.
        window: a sliding window: a query at position p sees keys ``p - window + 1 .. p``; its
            programs read only the window's tiles (docs/CONTRACTS.md, "Windows, sinks, chunks").
        chunk_size: chunked local attention: a query at p sees keys ``p // chunk_size *
            chunk_size .. p``. At most one of ``window`` and ``chunk_size``.
        sinks: ``[num_q_heads]`` (any float dtype, read as float32): each head's sink logit,
            a key of value zero in its softmax denominator (gpt-oss).
        fp8_widen_in_registers: an FP8 cache's tiles widen to bf16 queries' dtype in PTX
            (`ember.kernels.fp8_widen`), not by Triton's conversions.

    The split path allocates its fp32 partials (``num_seqs * num_q_heads * splits * (head_dim+2)``
    floats) with ``torch.empty``: no sync and capturable, but the only scratch this op uses.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of {num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must share dtype and layout")
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    if num_seqs == 0 or num_tokens == 0:
        return out
    if rope is not None:
        _check_decode_rope(rope, q, k_cache, all(launch.decode_only for launch in launches))
    key_range = key_start(window, chunk_size)
    if sinks is not None and (tuple(sinks.shape) != (num_q_heads,) or sinks.stride(0) != 1):
        raise ValueError(f"sinks must be contiguous [{num_q_heads}], got {tuple(sinks.shape)}")
    if split_counters is not None and (
        split_counters.dtype != torch.int32 or split_counters.numel() < num_seqs * num_kv_heads
    ):
        raise ValueError(f"split_counters must be int32 with >= {num_seqs * num_kv_heads} entries")
    for attention_launch in launches:
        tiles = chunk_tiles if attention_launch.chunk_map else None
        if tiles is not None:
            if tiles.block_q != attention_launch.tiles["BLOCK_Q"]:
                raise ValueError(
                    f"chunk tiles of {tiles.block_q} query tokens, the prefill tile "
                    f"serves {attention_launch.tiles['BLOCK_Q']}"
                )
            if tiles.grid == 0:
                continue  # no chunk in this step
        _launch_kernel(
            q,
            k_cache,
            v_cache,
            out,
            query_start_loc,
            seq_lens,
            block_tables,
            scale,
            attention_launch,
            split_counters,
            rope,
            pdl,
            tiles,
            kv_scales,
            key_range,
            sinks,
            fp8_widen_in_registers,
        )
    return out


def _launch_kernel(
    q,
    k_cache,
    v_cache,
    out,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    plan: AttentionLaunch,
    split_counters,
    rope,
    pdl,
    chunk_tiles,
    kv_scales=(1.0, 1.0),
    key_range=(KeyStart.CAUSAL, 0),
    sinks=None,
    fp8_widen_in_registers=False,
):
    """One launch of `_paged_attention_kernel` over the step as ``plan`` says; over the tiles
    of ``chunk_tiles`` when given (``kv_scales``: an FP8 cache's, ``key_range``: `key_start`'s
    answer for the layer's window or chunks, ``sinks`` and ``fp8_widen_in_registers``: see
    `paged_attention`)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    config, splits = plan.tiles, plan.splits
    split_kv = splits > 1
    if split_kv:
        if split_counters is None:
            split_counters = torch.zeros(
                num_seqs * num_kv_heads, dtype=torch.int32, device=q.device
            )
        part_max = torch.empty(num_seqs * num_q_heads * splits, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(num_seqs * num_q_heads * splits * head_dim, device=q.device)
    else:
        part_max = part_sum = part_acc = out  # unused by the kernel when SPLIT_KV is off
    # RoPE in the kernel serves the launch of every sequence of a decode-only step.
    rope = rope if plan.decode_only and plan.sequences == Sequences.ALL else None
    row_args, block_p = row_norm_args(rope.row_norm if rope is not None else None, q)
    qk_norm = rope.qk_norm if rope is not None else None
    q_norm, k_norm, rms_eps = qk_norm_args(qk_norm, head_dim, q)
    qk_l2_norm_eps = rope.qk_l2_norm_eps if rope is not None else None
    if plan.decode_only:
        num_tiles = num_seqs
    elif chunk_tiles is not None:
        num_tiles = chunk_tiles.grid
    else:
        num_tiles = num_tokens // config["BLOCK_Q"] + num_seqs  # see _find_sequence
    group = num_q_heads // num_kv_heads
    k_scale, v_scale = kv_scale_args(k_cache, kv_scales)
    qk_scale = scale * _LOG2E * (k_scale if k_scale is not None else 1.0)
    launch(
        _paged_attention_kernel,
        (num_tiles, num_kv_heads, splits),
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        part_max,
        part_sum,
        part_acc,
        split_counters if split_kv else seq_lens,
        *(
            (rope.k, rope.v, rope.positions, rope.cos_sin_cache, rope.slot_mapping)
            if rope is not None
            else (q, q, seq_lens, q, seq_lens)
        ),
        chunk_tiles.tiles if chunk_tiles is not None else seq_lens,
        sinks if sinks is not None else q,
        q_norm,
        k_norm,
        *row_args,
        rms_eps,
        qk_l2_norm_eps or 0.0,
        key_range[1],
        qk_scale,
        k_scale,
        v_scale,
        num_seqs,
        splits,
        cdiv(plan.min_split_tokens, config["BLOCK_N"]),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        *(
            (rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1))
            if rope is not None
            else (0, 0, 0, 0)
        ),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        DECODE_ONLY=plan.decode_only,
        SPLIT_KV=split_kv,
        # fp32 inputs must not silently drop to tf32 on the tensor cores.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_SPLITS=next_power_of_2(splits),
        GROUP_P2=max(2, next_power_of_2(group)),
        MERGE_CHUNK=min(_MAX_MERGE_CHUNK, next_power_of_2(splits)),
        ROPE=rope is not None,
        ROW_NORM=rope is not None and rope.row_norm is not None,
        BLOCK_P=block_p,
        PDL=pdl,
        PRELOAD_KV=rope is not None and plan.preload_kv,
        SEQUENCES=int(plan.sequences),
        TILE_MAP=chunk_tiles is not None,
        KV_FP8=_kv_fp8_mode(k_cache, fp8_widen_in_registers),
        KEY_START=int(key_range[0]),
        SINKS=sinks is not None,
        ROTATE=rope is None or rope.rotate,
        QK_RMS_NORM=qk_norm is not None,
        QK_L2_NORM=qk_l2_norm_eps is not None,
        launch_pdl=pdl,
        **config,
    )
