"""The fused MoE's table: which path and tiles a shape and token count get, from measured rows
or the heuristics, and that the heuristics' tiles fit an SM."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.moe_tiles import (
    GemmTiles,
    MeasuredMoeTiles,
    MoeShape,
    MoeTiles,
    MoeTuning,
    cdiv,
    default_moe_tiles,
    gemv_moe_tiles,
    shared_memory_estimate,
)
from ember.kernels.tiles import SHARED_MEMORY_BUDGET
from ember.kernels.tuning import KernelTuning

GPT_OSS = MoeShape(32, 2880, 2880, 4)
QWEN3 = MoeShape(128, 2048, 768, 8)


def test_decode_runs_by_pair_and_larger_steps_grouped_on_growing_blocks():
    tuning = MoeTuning(by_pair_max_tokens=4)
    assert [tuning.tiles_for(QWEN3, t).by_pair for t in (1, 4, 5)] == [True, True, False]
    # Rows per expert: 0.5 at 8 tokens, 16 at 256, 64 at 1024, 256 at 4096.
    assert [tuning.tiles_for(QWEN3, t).block_m for t in (8, 256, 1024, 4096)] == [16, 16, 64, 128]


def test_down_runs_per_pair_where_one_tokens_column_tiles_leave_the_gpu_idle():
    tuning = MoeTuning(num_sms=132, by_pair_max_tokens=4)
    # One token: 128 (Qwen3) or 180 (gpt-oss) column tiles of 16, under two waves of 132 SMs.
    assert [tuning.tiles_for(s, 1).down_by_token for s in (QWEN3, GPT_OSS)] == [False, False]
    assert [tuning.tiles_for(s, 4).down_by_token for s in (QWEN3, GPT_OSS)] == [True, True]
    # A row measured before the choice existed reads back as down per token.
    row = default_moe_tiles(QWEN3, 1).as_dict()
    del row["down_by_token"]
    assert MoeTiles.from_dict(row).down_by_token


def test_decode_streams_fill_the_gpu_twice_over_where_16_columns_allow():
    for shape in (GPT_OSS, QWEN3):
        tiles = default_moe_tiles(shape, 1, MoeTuning(num_sms=132))
        programs = shape.top_k * cdiv(shape.intermediate, tiles.gate_up.block_n)
        assert programs >= 2 * 132 or tiles.gate_up.block_n == 16
    # Fewer SMs: wider columns serve.
    assert default_moe_tiles(QWEN3, 1, MoeTuning(num_sms=8)).gate_up.block_n == 64


def test_mxfp4_streams_keep_64_columns_however_few_programs_that_makes():
    """MXFP4 products are bound by decoding the weights, which narrower tiles repeat across a
    program's threads; bf16 streams narrow to fill the GPU."""
    mxfp4 = GPT_OSS._replace(mxfp4=True)
    for tokens in (1, 4, 16):
        tiles = default_moe_tiles(mxfp4, tokens, MoeTuning(num_sms=132, by_pair_max_tokens=0))
        assert (tiles.gate_up.block_n, tiles.down.block_n) == (64, 64), tokens
        assert (tiles.gate_up.block_k, tiles.down.block_k) == (128, 128), tokens
    assert default_moe_tiles(GPT_OSS, 1, MoeTuning(num_sms=132)).gate_up.block_n < 64


def test_mxfp4_decode_runs_the_gemv_on_the_tiles_both_hoppers_measured_fastest():
    """MXFP4 experts up to `MoeTuning.by_pair_max_tokens` tokens: the CUDA-core GEMV on 8-column
    tiles, K steps of 256 in one stage on two warps; down in K steps of 512, two stages, four
    warps while one token's programs fill under four waves (the H100 and H200 tables' rows at
    1 and 4 tokens). Past the by-pair bound, and for bf16 experts, `tl.dot`'s tiles."""
    mxfp4 = GPT_OSS._replace(mxfp4=True)
    tuning = MoeTuning(num_sms=132)
    short = GemmTiles(8, 256, 1, 2)
    one, four = default_moe_tiles(mxfp4, 1, tuning), default_moe_tiles(mxfp4, 4, tuning)
    assert one.gemv and four.gemv and one.by_pair and one.down_by_token
    assert (one.gate_up, one.down) == (short, GemmTiles(8, 512, 2, 4))
    assert (four.gate_up, four.down) == (short, short)
    assert not default_moe_tiles(mxfp4, 5, tuning).gemv
    assert not default_moe_tiles(GPT_OSS, 1, tuning).gemv
    # A tiny shape's K steps stay within its K, in whole scale groups.
    tiny = default_moe_tiles(MoeShape(4, 64, 32, 2, mxfp4=True), 1, tuning)
    assert (tiny.gate_up.block_k, tiny.down.block_k) == (64, 32)


def test_heuristic_tiles_fit_shared_memory():
    for shape in (GPT_OSS, QWEN3, GPT_OSS._replace(elem_bytes=4)):
        for tokens in (1, 4, 16, 64, 256, 1024, 8192):
            tiles = default_moe_tiles(shape, tokens)
            streams = tiles.block_m == 16
            budget = SHARED_MEMORY_BUDGET // 2 if streams else SHARED_MEMORY_BUDGET
            for gemm, gated in ((tiles.gate_up, True), (tiles.down, False)):
                assert shared_memory_estimate(tiles.block_m, gemm, shape.elem_bytes, gated) <= (
                    budget
                ), (shape, tokens, gemm)


def test_measured_rows_win_up_to_their_bound_then_the_heuristics():
    tiles = MoeTiles(False, 32, GemmTiles(32, 64, 3, 4, 2), GemmTiles(64, 64, 3, 4, 2))
    wider = MoeTiles(False, 64, GemmTiles(64, 64, 3, 8, 8), GemmTiles(128, 64, 3, 8, 8))
    tuning = MoeTuning().with_measured(
        MeasuredMoeTiles(QWEN3, 64, wider), MeasuredMoeTiles(QWEN3, 16, tiles)
    )
    assert tuning.tiles_for(QWEN3, 10) == tiles
    assert tuning.tiles_for(QWEN3, 16) == tiles
    assert tuning.tiles_for(QWEN3, 17) == wider
    assert tuning.tiles_for(QWEN3, 65) == default_moe_tiles(QWEN3, 65)
    assert tuning.tiles_for(GPT_OSS, 10) == default_moe_tiles(GPT_OSS, 10)
    # A row for the same shape and bound replaces the earlier one.
    replaced = tuning.with_measured(MeasuredMoeTiles(QWEN3, 16, wider))
    assert replaced.tiles_for(QWEN3, 10) == wider and len(replaced.measured) == 2


def test_tiles_round_trip_through_a_dict():
    tiles = MoeTiles(True, 16, GemmTiles(16, 256, 4, 4), GemmTiles(32, 128, 3, 4, 1))
    assert MoeTiles.from_dict(tiles.as_dict()) == tiles
    gemv = gemv_moe_tiles(GPT_OSS, 1)
    assert MoeTiles.from_dict(gemv.as_dict()) == gemv and gemv.gemv
    old_row = {k: v for k, v in tiles.as_dict().items() if k != "gemv"}  # a file from before
    assert not MoeTiles.from_dict(old_row).gemv


def test_gemv_tiles_fill_the_gpu_four_times_below_16_columns():
    """One token of gpt-oss: 4 pairs of 2880 gate/up columns and one token of 2880 down columns
    take column tiles that give at least four programs an SM where 2 columns allow."""
    for shape, tokens in ((GPT_OSS, 1), (QWEN3, 1), (GPT_OSS, 4)):
        tiles = gemv_moe_tiles(shape, tokens, MoeTuning(num_sms=132))
        assert tiles.by_pair and tiles.down_by_token and tiles.gemv
        gate_up_programs = tokens * shape.top_k * cdiv(shape.intermediate, tiles.gate_up.block_n)
        down_programs = tokens * cdiv(shape.hidden, tiles.down.block_n)
        for programs, gemm in ((gate_up_programs, tiles.gate_up), (down_programs, tiles.down)):
            assert programs >= 4 * 132 or gemm.block_n == 2
            assert programs < 8 * 132 or gemm.block_n == 32  # the widest that fills them
    assert gemv_moe_tiles(GPT_OSS, 1).down.block_n < 16  # past tl.dot's floor


def test_gemv_threads_take_at_least_32_values_a_step_where_the_tile_has_them():
    for shape, tokens in ((GPT_OSS, 1), (QWEN3, 1), (GPT_OSS, 4), (GPT_OSS, 16)):
        tiles = gemv_moe_tiles(shape, tokens, MoeTuning(num_sms=132))
        for gemm in (tiles.gate_up, tiles.down):
            per_thread = gemm.block_n * gemm.block_k / (gemm.num_warps * 32)
            assert per_thread >= 32 or gemm.num_warps == 1, (shape, tokens, gemm)
            assert gemm.num_warps == 4 or per_thread < 64, (shape, tokens, gemm)


def test_the_gemv_path_runs_by_pair_with_down_by_token():
    gemm = GemmTiles(8, 256, 2, 4)
    with pytest.raises(ValueError, match="by pair with down by token"):
        MoeTiles(False, 16, gemm, gemm, gemv=True)
    with pytest.raises(ValueError, match="by pair with down by token"):
        MoeTiles(True, 16, gemm, gemm, down_by_token=False, gemv=True)


def test_the_device_table_carries_the_sm_count():
    tuning = KernelTuning.for_device(torch.device("cpu"))
    assert tuning.moe.num_sms == tuning.attention.num_sms == 132
