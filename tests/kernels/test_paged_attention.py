"""Paged attention kernel vs the PyTorch reference on ragged, mixed, shuffled-block steps."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from ember.kernels.attention_plan import (
    AttentionLaunch,
    AttentionPlanner,
    AttentionTuning,
    ChunkTiles,
    Sequences,
)
from ember.kernels.paged_attention import paged_attention
from ember.layers.reference_ops import paged_attention_reference

pytestmark = pytest.mark.slow

TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass
class Step:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int

    def args(self):
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
        )


def make_step(
    gen,
    device,
    q_lens,
    seq_lens,
    *,
    num_kv_heads,
    group,
    head_dim,
    page=16,
    dtype=torch.float32,
) -> Step:
    """Random q and cache; each sequence's blocks are a shuffled, non-contiguous draw (never
    block 0), and tables have unused trailing entries."""
    blocks_per_seq = [-(-n // page) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(blocks_per_seq) + 2, dtype=torch.int32)
    for seq, n in enumerate(blocks_per_seq):
        table[seq, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_blocks, page, num_kv_heads, head_dim)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return Step(
        q=q.to(dtype).to(device),
        k_cache=torch.randn(shape, generator=gen).to(dtype).to(device),
        v_cache=torch.randn(shape, generator=gen).to(dtype).to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def planner_for(step: Step, num_sms: int = 132) -> AttentionPlanner:
    """The planner of the step's shape on a GPU of ``num_sms`` SMs (an H200's table else)."""
    num_q_heads, head_dim = step.q.shape[1], step.q.shape[2]
    tuning = AttentionTuning(num_sms=num_sms)
    return AttentionPlanner(
        tuning, num_q_heads, step.k_cache.shape[2], head_dim, step.q.element_size()
    )


def plan_for(step: Step, *, num_sms: int = 132, splits: int | None = None, bound: int = 0):
    """The step's launches as the engine plans them (``bound``: a graph's longer max_seq_len)."""
    planner = planner_for(step, num_sms)
    max_seq_len = bound or step.max_seq_len
    return planner.plan(step.seq_lens.shape[0], step.max_query_len, max_seq_len, splits=splits)


def run_both(
    step: Step,
    *,
    launches: tuple[AttentionLaunch, ...] | None = None,
    splits: int | None = None,
    num_sms: int = 132,
    **kernel_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = step.q.shape[-1] ** -0.5
    out = torch.full_like(step.q, float("nan"))  # poisoned: every row must be written
    if launches is None:
        launches = plan_for(step, num_sms=num_sms, splits=splits)
    paged_attention(*step.args(), scale, out, launches, **kernel_kwargs)
    expected = paged_attention_reference(
        *(t.cpu() for t in step.args()),
        scale,
        torch.empty_like(step.q, device="cpu"),
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
    )
    return out.cpu(), expected


def assert_close(actual, expected, dtype):
    assert not actual.isnan().any(), "kernel left rows unwritten"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def test_reference_matches_dense_attention(gen):
    """The reference itself, against a token-by-token dense softmax over the gathered cache."""
    q_lens, seq_lens = [3, 1], [20, 9]
    step = make_step(gen, "cpu", q_lens, seq_lens, num_kv_heads=2, group=2, head_dim=16, page=4)
    _, got = run_both_reference_only(step)
    page, group = 4, 2
    for seq, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        blocks = step.block_tables[seq].long()
        for j in range(q_len):
            tok = int(step.query_start_loc[seq]) + j
            pos = seq_len - q_len + j
            slots = [(int(blocks[p // page]), p % page) for p in range(pos + 1)]
            for head in range(4):
                kv = head // group
                keys = torch.stack([step.k_cache[b, o, kv] for b, o in slots])
                values = torch.stack([step.v_cache[b, o, kv] for b, o in slots])
                weights = torch.softmax(keys @ step.q[tok, head] * 16**-0.5, dim=0)
                torch.testing.assert_close(got[tok, head], weights @ values)


def run_both_reference_only(step: Step):
    out = torch.empty_like(step.q)
    return None, paged_attention_reference(
        *step.args(),
        step.q.shape[-1] ** -0.5,
        out,
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
    )


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_ragged_gqa(gen, device, group, dtype):
    seq_lens = [1, 17, 64, 100, 33]  # partial blocks, an exact tile, a single token
    step = make_step(
        gen,
        device,
        [1] * len(seq_lens),
        seq_lens,
        num_kv_heads=2,
        group=group,
        head_dim=64,
        dtype=dtype,
    )
    assert_close(*run_both(step, splits=1), dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_head_dims(gen, device, head_dim):
    step = make_step(
        gen,
        device,
        [1, 1, 1],
        [70, 5, 129],
        num_kv_heads=2,
        group=4,
        head_dim=head_dim,
        dtype=torch.bfloat16,
    )
    assert_close(*run_both(step, splits=1), torch.bfloat16)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_split_kv(gen, device, num_splits, dtype):
    """Forced split-KV: long sequences use every split, short ones leave splits empty."""
    seq_lens = [300, 7, 130, 64]
    step = make_step(
        gen, device, [1] * 4, seq_lens, num_kv_heads=2, group=4, head_dim=64, dtype=dtype
    )
    assert_close(*run_both(step, splits=num_splits), dtype)


def test_decode_split_kv_chosen_by_heuristic(gen, device):
    """Few sequences and few SMs: the wrapper picks more than one split on its own."""
    step = make_step(gen, device, [1, 1], [600, 513], num_kv_heads=1, group=4, head_dim=64)
    assert planner_for(step, num_sms=8).num_splits(2, step.max_seq_len) == 8
    assert_close(*run_both(step, num_sms=8), torch.float32)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode(gen, device, group, dtype):
    """Prefill chunks (one from scratch, some starting mid-sequence) interleaved with decodes."""
    contexts = [0, 30, 20, 70, 9, 0]
    q_lens = [21, 1, 17, 1, 40, 1]
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    step = make_step(
        gen, device, q_lens, seq_lens, num_kv_heads=2, group=group, head_dim=64, dtype=dtype
    )
    assert_close(*run_both(step), dtype)


@pytest.mark.parametrize("separate_decodes", [True, False])
def test_mixed_step_either_launch_plan(gen, device, separate_decodes):
    """Decodes before, between and after chunks, a one-token chunk mid-sequence (a decode's
    launch serves it), and a padding sequence: both plans give the reference's output."""
    contexts = [40, 0, 12, 100, 3, 0, 64]
    q_lens = [1, 33, 1, 1, 18, 0, 1]
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    step = make_step(
        gen, device, q_lens, seq_lens, num_kv_heads=2, group=4, head_dim=64, dtype=torch.bfloat16
    )
    launches = None  # the engine's: decodes and chunks in launches of their own
    if not separate_decodes:  # one launch on prefill tiles for all
        launches = (AttentionLaunch(planner_for(step).prefill_tiles, False),)
    assert_close(*run_both(step, launches=launches), torch.bfloat16)


def test_mixed_step_cuts_long_decodes_into_segments(gen, device):
    """A mixed step's decodes past one segment's minimum are split and merged (a 2,200-token
    decode: three segments), short ones are not; the chunk beside them is unaffected."""
    contexts, q_lens = [2 * AttentionTuning().min_tokens_per_split + 151, 0, 40], [1, 24, 1]
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    step = make_step(gen, device, q_lens, seq_lens, num_kv_heads=1, group=4, head_dim=32)
    counters = torch.zeros(3, dtype=torch.int32, device=device)
    assert_close(*run_both(step, split_counters=counters), torch.float32)
    assert not counters.any(), "the merging program zeroes its counter again"


def test_chunk_tile_map_covers_each_chunk_once():
    """One entry per query tile of each multi-token sequence, in order; decodes (one token) and
    padding (none) get no tile, the entries past the count are left as they were."""
    import numpy as np

    planner = AttentionPlanner(AttentionTuning(), 8, 2, 64, 2)  # GQA 4: 32-token chunk tiles
    assert planner.chunk_query_tile == 32
    q_lens = [1, 33, 1, 1, 64, 2, 0, 1]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    out = np.full(12, -7, dtype=np.int32)
    n = planner.chunk_tile_map(qsl, len(q_lens), out)
    pairs = [(int(e) >> 16, int(e) & 0xFFFF) for e in out[:n]]
    assert pairs == [(1, 0), (1, 1), (4, 0), (4, 1), (5, 0)]
    assert (out[n:] == -7).all()
    assert planner.chunk_tile_bound(sum(q_lens), len(q_lens)) >= n
    with pytest.raises(ValueError, match="do not fit"):
        planner.chunk_tile_map(qsl, len(q_lens), np.zeros(4, dtype=np.int32))


@pytest.mark.parametrize("group", [1, 4])
def test_mixed_step_over_a_chunk_tile_map(gen, device, group):
    """The chunk launch over the host's tile map, its grid padded with spare (-1) programs as in
    a CUDA graph: decodes between chunks, a one-token chunk, a padding sequence, and a chunk
    longer than one tile."""
    import numpy as np

    contexts = [40, 0, 12, 100, 3, 0, 64, 9]
    q_lens = [1, 70, 1, 1, 18, 0, 1, 2]
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    num_kv_heads = 2
    step = make_step(
        gen,
        device,
        q_lens,
        seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=32,
        dtype=torch.bfloat16,
    )
    planner = planner_for(step)
    block_q = planner.chunk_query_tile
    tiles = np.full(16, -1, dtype=np.int32)
    count = planner.chunk_tile_map(step.query_start_loc.cpu().numpy(), len(q_lens), tiles)
    assert count == sum(-(-n // block_q) for n in q_lens if n > 1)
    chunk_tiles = ChunkTiles(torch.from_numpy(tiles).to(device), count + 3, block_q)
    assert_close(*run_both(step, chunk_tiles=chunk_tiles), torch.bfloat16)
    with pytest.raises(ValueError, match="prefill tile"):
        run_both(step, chunk_tiles=chunk_tiles._replace(block_q=block_q + 1))


@pytest.mark.parametrize("group", [1, 8])
def test_mixed_step_launches_serve_their_own_sequences(gen, device, group):
    """Each launch of a mixed step writes the rows of its own kind of sequence and no other:
    the single-token launch leaves every chunk row as it was (a chunk's first row written on
    decode tiles would be wrong, and hidden by the other launch's rewrite), the multi-token
    launch every decode row."""
    from ember.kernels.paged_attention import _launch_kernel

    contexts, q_lens = [30, 0, 7, 50], [1, 20, 1, 5]
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    step = make_step(gen, device, q_lens, seq_lens, num_kv_heads=2, group=group, head_dim=32)
    _, expected = run_both(step)
    decode_rows = torch.tensor([n == 1 for n in q_lens]).repeat_interleave(torch.tensor(q_lens))
    scale = step.q.shape[-1] ** -0.5
    planner = planner_for(step)
    for sequences, decode_only, served in [
        (Sequences.SINGLE_TOKEN, True, decode_rows),
        (Sequences.MULTI_TOKEN, False, ~decode_rows),
    ]:
        out = torch.full_like(step.q, float("nan"))
        tiles = planner.decode_tiles() if decode_only else planner.prefill_tiles
        _launch_kernel(
            step.q,
            step.k_cache,
            step.v_cache,
            out,
            step.query_start_loc,
            step.seq_lens,
            step.block_tables,
            scale,
            AttentionLaunch(tiles, decode_only, sequences),
            None,
            None,
            False,
            None,
        )
        out = out.cpu()
        assert out[~served].isnan().all(), "a launch wrote rows of the other kind"
        assert_close(out[served], expected[served], torch.float32)


def test_prefill_long_chunk_head_dim_128(gen, device):
    """A chunk spanning several query tiles and key tiles, mid-sequence, head_dim 128."""
    step = make_step(
        gen,
        device,
        [150, 2],
        [170, 40],
        num_kv_heads=1,
        group=4,
        head_dim=128,
        page=8,
        dtype=torch.bfloat16,
    )
    assert_close(*run_both(step), torch.bfloat16)


def test_strided_views_and_empty_sequence(gen, device):
    """q as a slice of a fused qkv buffer, and a zero-length (padding) sequence in the batch."""
    step = make_step(gen, device, [4, 0, 1], [10, 3, 50], num_kv_heads=2, group=2, head_dim=32)
    qkv = torch.randn(step.q.shape[0], 8 * 32, generator=gen).to(device)
    q = qkv[:, : 4 * 32].view(-1, 4, 32)
    q.copy_(step.q)
    step.q = q
    assert q.stride(0) == 8 * 32
    assert_close(*run_both(step), torch.float32)


def test_decode_with_empty_sequence_split(gen, device):
    step = make_step(gen, device, [1, 0, 1], [40, 3, 300], num_kv_heads=1, group=4, head_dim=32)
    assert_close(*run_both(step, splits=3), torch.float32)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_split_kv_merged_in_kernel(gen, device, group, dtype):
    """The last split program of each (sequence, KV head) merges, counting arrivals in the
    caller's counters: the reference's answers, an empty (padding) sequence untouched, and the
    counters zero again after each launch, so they serve the next (as across layers and graph
    replays)."""
    q_lens, seq_lens = [1, 1, 0, 1], [300, 7, 2, 130]
    step = make_step(
        gen, device, q_lens, seq_lens, num_kv_heads=2, group=group, head_dim=64, dtype=dtype
    )
    counters = torch.zeros(4 * 2 + 3, dtype=torch.int32, device=device)
    for num_splits in (5, 3, 19):  # 19: several unrolled merge chunks, most splits empty
        assert_close(*run_both(step, splits=num_splits, split_counters=counters), dtype)
        assert not counters.any()


@pytest.mark.parametrize("num_sms", [132, 4])
def test_decode_split_grid_for_a_longer_bound(gen, device, num_sms):
    """A grid cut for a bound far past the step's sequences (a CUDA graph's ``max_seq_len``):
    each sequence takes only the segments its own length calls for (132 SMs: 64-token ones, so
    18, 2 and 1 of the grid's 32; 4 SMs, where the programs fill a wave: 1,024-token ones, so
    2, 1 and 1 of 2, and no merge for the two short sequences), the surplus programs take no
    arrival (the counters end at zero), and the answers are the reference's."""
    seq_lens, bound = [1100, 100, 1], 8320
    step = make_step(
        gen, device, [1] * 3, seq_lens, num_kv_heads=2, group=4, head_dim=32, dtype=torch.bfloat16
    )
    assert planner_for(step, num_sms).num_splits(3, bound) == (32 if num_sms == 132 else 2)
    scale = step.q.shape[-1] ** -0.5
    counters = torch.zeros(3 * 2, dtype=torch.int32, device=device)
    out = torch.full_like(step.q, float("nan"))
    launches = plan_for(step, num_sms=num_sms, bound=bound)
    paged_attention(*step.args(), scale, out, launches, split_counters=counters)
    expected = paged_attention_reference(
        *(t.cpu() for t in step.args()),
        scale,
        torch.empty_like(step.q, device="cpu"),
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )
    assert_close(out.cpu(), expected, torch.bfloat16)
    assert not counters.any()


@pytest.mark.parametrize("num_sms", [132, 1])  # 1: unsplit, the one-warp programs
@pytest.mark.parametrize("preload_kv", [False, True])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize(("num_splits", "dtype"), [(1, torch.bfloat16), (3, torch.float32)])
# The second set puts each new key at a tile's last or first row (32- and 64-key tiles).
@pytest.mark.parametrize("seq_lens", [[300, 7, 65, 1], [64, 32, 65, 33]])
def test_decode_with_rope_and_cache_write_in_kernel(
    gen, device, group, num_splits, dtype, preload_kv, num_sms, seq_lens
):
    """RoPE + KV write inside the decode kernel give the outputs and the caches of the RoPE
    kernel's reference followed by attention's; a padded token (slot -1) writes nothing. With
    ``preload_kv`` each segment's first tile is read before the new key is stored, and the tile
    that holds it (the 7- and 1-token sequences'; with 3 splits every sequence's) must take its
    row from registers, or keep the cache's for the padded token. The second ``seq_lens`` puts
    the new keys at tile edges, where a tile read without the causal mask could hold them."""
    from ember.kernels.paged_attention import DecodeRope
    from ember.layers.reference_ops import build_cos_sin_cache, rope_and_cache_write_reference

    num_kv_heads, head_dim, page = 2, 64, 16
    step = make_step(
        gen,
        device,
        [1] * 4,
        seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page=page,
        dtype=dtype,
    )
    new_k = torch.randn(4, num_kv_heads, head_dim, generator=gen).to(dtype)
    new_v = torch.randn(4, num_kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.tensor(seq_lens) - 1
    table = step.block_tables.cpu().long()
    slots = table[torch.arange(4), positions // page] * page + positions % page
    slots[2] = -1  # a padded token
    cos_sin = build_cos_sin_cache(head_dim, 512, 10000.0, None)
    scale = head_dim**-0.5
    meta = {"max_query_len": 1, "max_seq_len": max(seq_lens)}

    ref_q, ref_k, ref_v = step.q.cpu().clone(), new_k.clone(), new_v.clone()
    ref_k_cache, ref_v_cache = step.k_cache.cpu().clone(), step.v_cache.cpu().clone()
    rope_and_cache_write_reference(
        ref_q, ref_k, ref_v, positions, cos_sin, slots, ref_k_cache, ref_v_cache
    )
    expected = paged_attention_reference(
        ref_q,
        ref_k_cache,
        ref_v_cache,
        step.query_start_loc.cpu(),
        step.seq_lens.cpu(),
        table.int(),
        scale,
        torch.empty_like(ref_q),
        **meta,
    )

    rope = DecodeRope(
        new_k.to(device),
        new_v.to(device),
        positions.to(device),
        cos_sin.to(device),
        slots.to(device),
    )
    out = torch.full_like(step.q, float("nan"))
    counters = torch.zeros(4 * num_kv_heads, dtype=torch.int32, device=device)
    (launch,) = plan_for(step, num_sms=num_sms, splits=num_splits)
    launch = dataclasses.replace(launch, preload_kv=preload_kv)  # as under PDL, small batches
    paged_attention(*step.args(), scale, out, (launch,), split_counters=counters, rope=rope)
    assert_close(out.cpu(), expected, dtype)
    torch.testing.assert_close(step.k_cache.cpu(), ref_k_cache)
    torch.testing.assert_close(step.v_cache.cpu(), ref_v_cache)


def test_rope_in_kernel_is_for_decode_only(gen, device):
    from ember.kernels.paged_attention import DecodeRope

    step = make_step(gen, device, [2], [5], num_kv_heads=1, group=1, head_dim=16)
    rope = DecodeRope(
        step.q[:, :1],
        step.q[:, :1],
        step.seq_lens.long(),
        torch.zeros(8, 16, device=device),
        step.seq_lens.long(),
    )
    with pytest.raises(ValueError, match="decode-only"):
        run_both(step, rope=rope)


def test_split_counters_are_checked(gen, device):
    step = make_step(gen, device, [1, 1], [40, 90], num_kv_heads=2, group=2, head_dim=32)
    too_few = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="split_counters"):
        run_both(step, splits=2, split_counters=too_few)


def test_split_heuristic():
    """On an H200's table (132 SMs, an 8B model's 8 KV heads)."""
    planner = AttentionPlanner(AttentionTuning(), 32, 8, 128, 2)
    # Under one wave (8 programs on 132 SMs): split down to 64-key segments, at most 32.
    assert planner.num_splits(1, 512) == 8
    assert planner.num_splits(1, 4096) == 32
    assert planner.num_splits(8, 512) == 5  # 64 programs: 5 x 64 fill two per SM
    # A full wave: split only segments of 1,024 tokens or more.
    assert planner.num_splits(32, 512) == 1
    assert planner.num_splits(32, 4096) == 2
    # Enough programs already: no split.
    assert planner.num_splits(64, 4096) == 1
    assert planner.num_splits(256, 4096) == 1
    # Another GPU's table splits by its own numbers.
    small = AttentionPlanner(AttentionTuning(num_sms=16, max_splits=4), 32, 8, 128, 2)
    assert small.num_splits(1, 4096) == 4


def test_split_kv_rejected_for_prefill(gen, device):
    step = make_step(gen, device, [3], [3], num_kv_heads=1, group=1, head_dim=16)
    with pytest.raises(ValueError, match="decode-only"):
        run_both(step, splits=2)


@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_tile_configs_fit_in_shared_memory(decode_only, head_dim, elem_bytes):
    """An fp32 8B model once failed to launch its prefill tiles on an H200 (256 KiB asked,
    227 KiB there): every config must fit, and where the table's tiles fit they are kept."""
    from ember.kernels.attention_plan import shared_memory_estimate

    tuning = AttentionTuning()
    planner = AttentionPlanner(tuning, 16, 4, head_dim, elem_bytes)
    tiles = planner.decode_tiles(split_kv=True) if decode_only else planner.prefill_tiles
    assert shared_memory_estimate(tiles, head_dim, elem_bytes) <= tuning.shared_memory_budget
    assert tiles["BLOCK_N"] >= 16 and tiles["KV_STAGES"] >= 1
    wanted = tuning.split_decode_tiles if decode_only else tuning.prefill_tiles
    as_wanted = dict(tiles, BLOCK_N=wanted[0], KV_STAGES=wanted[2])
    if shared_memory_estimate(as_wanted, head_dim, elem_bytes) <= tuning.shared_memory_budget:
        assert (tiles["BLOCK_N"], tiles["num_warps"], tiles["KV_STAGES"]) == wanted


def test_full_decode_grids_take_one_warp_programs():
    """Unsplit decode launches with enough programs per SM run the table's one-warp tiles;
    fewer programs, split launches and a mixed step's decodes keep theirs."""
    tuning = AttentionTuning(num_sms=4)
    planner = AttentionPlanner(tuning, 16, 4, 128, 2)

    def shape(tiles):
        return tiles["BLOCK_N"], tiles["num_warps"], tiles["KV_STAGES"]

    full = tuning.one_warp_min_programs_per_sm * tuning.num_sms / 4  # sequences, 4 KV heads
    (launch,) = planner.plan(int(full), 1, 64, splits=1)
    assert shape(launch.tiles) == tuning.one_warp_decode_tiles
    (launch,) = planner.plan(int(full) - 1, 1, 64, splits=1)
    assert shape(launch.tiles) == tuning.decode_tiles
    (launch,) = planner.plan(int(full), 1, 64, splits=2)
    assert shape(launch.tiles) == tuning.split_decode_tiles
    decodes, _ = planner.plan(int(full), 7, 64)
    assert shape(decodes.tiles) == tuning.decode_tiles


@pytest.mark.parametrize(
    ("group", "dtype"), [(1, torch.float32), (4, torch.bfloat16), (8, torch.float32)]
)
def test_decode_on_one_warp_programs(gen, device, group, dtype):
    """A decode step whose grid fills the SMs (two of them here) runs on one-warp programs,
    with ragged lengths."""
    seq_lens = [1, 17, 64, 100, 33, 129, 31, 32, 65, 2, 90, 48]
    step = make_step(
        gen,
        device,
        [1] * len(seq_lens),
        seq_lens,
        num_kv_heads=2,
        group=group,
        head_dim=64,
        dtype=dtype,
    )
    (launch,) = plan_for(step, num_sms=2, splits=1)
    assert launch.tiles["num_warps"] == 1
    assert_close(*run_both(step, launches=(launch,)), dtype)
