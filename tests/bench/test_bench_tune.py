"""`ember bench tune`'s sweeps, checked on the CPU: the shapes they sweep, and that every launch
of the attention sweep computes what the engine's planned launch computes."""

from __future__ import annotations

import json

import pytest
import torch

from ember.bench.tune import (
    GEMM_CONFIGS,
    AttentionShape,
    attend,
    attention_planner,
    cublas_layer,
    decode_attention_bytes,
    decode_inputs,
    fastest,
    fp8_sequence_weights,
    linear_shapes,
    skinny_configs,
    skinny_layer,
    sweep_launches,
)


def test_tune_sweeps_every_linear_layer_of_the_preset():
    shapes = {name: (n, k) for name, n, k in linear_shapes("llama-3.1-8b")}
    assert shapes["qkv"] == (4096 + 2 * 1024, 4096)
    assert shapes["gate_up"] == (2 * 14336, 4096)
    assert shapes["down"] == (4096, 14336)
    assert shapes["lm_head"] == (128256, 4096)
    assert AttentionShape.of("llama-3.1-8b") == AttentionShape(32, 8, 128, 16)


def test_tune_names_each_skinny_tile_once_with_m_padded():
    configs = skinny_configs(3)
    assert len(configs) == len(GEMM_CONFIGS)
    assert configs["n32_k256_s4_w4"] == {
        "BLOCK_M": 16,
        "BLOCK_N": 32,
        "BLOCK_K": 256,
        "STAGES": 4,
        "num_warps": 4,
    }
    assert {c["BLOCK_M"] for c in skinny_configs(33).values()} == {64}


@pytest.mark.parametrize("gated", [False, True])
def test_the_fp8_gemm_sweep_runs_twice_the_k_and_computes_the_engines_product(gated):
    """`bench tune --weight-dtype fp8`: the configs at twice their K (none past K), and each one
    the skinny kernel runs on the FP8 weights computes the product the engine computes past the
    skinny rows (here, with no `_scaled_mm` on the CPU, the dequantized weight's), to bf16
    rounding."""
    configs = ((16, 64, 2, 4), (32, 128, 2, 4), (32, 256, 2, 4))
    swept = skinny_configs(2, configs, k_scale=2, k=256)
    assert set(swept) == {"n16_k128_s2_w4", "n32_k256_s2_w4"}
    torch.manual_seed(0)
    n, k = 64, 256
    weights = fp8_sequence_weights(n, k, 2, device="cpu")
    assert weights[1].weight.dtype == torch.float8_e4m3fn and weights[1].scale.shape == (n,)
    x = torch.randn(2, k).to(torch.bfloat16)
    width = n // 2 if gated else n
    expected = torch.empty(2, width, dtype=torch.bfloat16)
    cublas_layer(
        x, weights, torch.empty(2, n, dtype=torch.bfloat16), expected if gated else None, 1
    )
    if not gated:
        from ember.kernels.fp8_gemm import fp8_linear

        expected = fp8_linear(x, weights[1])
    for name, config in swept.items():
        out = torch.full((2, width), float("nan"), dtype=torch.bfloat16)
        skinny_layer(x, weights, out, gated, False, dict(config), 1)
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2, msg=name)


def test_fastest_leaves_out_what_did_not_launch():
    assert fastest({"a": 2.0, "b": "OutOfResources: shared memory", "c": 1.5}) == "c"
    assert fastest({"a": "OutOfResources: shared memory"}) is None


def test_attention_sweep_covers_tiles_times_splits_that_fit_the_context():
    shape = AttentionShape.of("llama-3.1-8b")
    planner = attention_planner(shape, torch.device("cpu"))
    tiles = ((64, 2, 3), (16, 1, 4))
    sweep = sweep_launches(planner, context=100, tiles=tiles, splits=(1, 2, 4, 8))
    # A segment is one tile at least: 64 x 2 > 100 keys, 16 x 8 > 100.
    assert set(sweep) == {"n64_w2_s3_x1", "n16_w1_s4_x1", "n16_w1_s4_x2", "n16_w1_s4_x4"}
    for name, (launch,) in sweep.items():
        assert launch.decode_only and launch.min_split_tokens == 1
        assert launch.tiles["BLOCK_M"] == planner.decode_tiles()["BLOCK_M"] == 16
        assert name.endswith(f"_x{launch.splits}")


@pytest.mark.parametrize("context", [20, 70])
def test_every_swept_attention_launch_computes_the_planned_attention(context):
    """Each tile and split the sweep times runs the kernel on the engine's inputs to the same
    result as the planner's own launch (Triton's interpreter on the CPU)."""
    shape = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    planner = attention_planner(shape, torch.device("cpu"), elem_bytes=4)
    torch.manual_seed(context)
    batch = 3
    inputs = decode_inputs(shape, batch, context, torch.float32, device="cpu")
    inputs["seq_lens"] = torch.tensor([context, context // 2 + 1, 1], dtype=torch.int32)
    counters = torch.zeros(batch * shape.num_kv_heads, dtype=torch.int32)
    expected = torch.empty_like(inputs["q"])
    attend(inputs, expected, planner.plan(batch, 1, context), counters)
    sweep = sweep_launches(planner, context, tiles=((16, 1, 2), (32, 2, 1)), splits=(1, 2, 4))
    assert sweep
    for name, launches in sweep.items():
        out = torch.full_like(inputs["q"], float("nan"))
        attend(inputs, out, launches, counters)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=name)
    assert not counters.any()  # the split path leaves its arrival counters at zero


def test_the_fp8_cache_sweep_reads_half_the_kv_bytes_and_computes_the_planned_attention():
    """`bench tune --kv-cache-dtype fp8`: the FP8 planner's tiles, the roofline's K/V at one
    byte, and every swept launch over an e4m3 cache with bf16 queries agreeing with the
    planner's own launch (to bf16 rounding: the splits sum in another order)."""
    shape = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    bf16_bytes = decode_attention_bytes(shape, 3, 64, 2)
    fp8_bytes = decode_attention_bytes(shape, 3, 64, 2, cache_elem=1)
    assert bf16_bytes - fp8_bytes == 2 * 3 * 64 * 2 * 16  # K and V of every token, a byte less
    planner = attention_planner(shape, torch.device("cpu"), 1, query_elem_bytes=2)
    assert planner.elem_bytes == 1 and planner.query_elem_bytes == 2
    torch.manual_seed(0)
    batch, context = 3, 40
    inputs = decode_inputs(
        shape, batch, context, torch.bfloat16, device="cpu", cache_dtype=torch.float8_e4m3fn
    )
    assert inputs["k_cache"].dtype == inputs["v_cache"].dtype == torch.float8_e4m3fn
    counters = torch.zeros(batch * shape.num_kv_heads, dtype=torch.int32)
    expected = torch.empty_like(inputs["q"])
    attend(inputs, expected, planner.plan(batch, 1, context), counters)
    for name, launches in sweep_launches(
        planner, context, tiles=((16, 1, 2), (32, 2, 1)), splits=(1, 4)
    ).items():
        out = torch.full_like(inputs["q"], float("nan"))
        attend(inputs, out, launches, counters)
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2, msg=name)


# -- moe -------------------------------------------------------------------------------------


def test_moe_paths_by_pair_at_decode_and_grouped_block_sizes_up_to_the_rows_per_expert():
    from ember.bench.tune_moe import MOE_SHAPES, paths_for

    qwen = MOE_SHAPES["qwen3-30b-a3b"]
    paths = paths_for(qwen, 1, 132)
    assert set(paths) == {"by_pair", "by_pair_split", "by_pair_gemv", "grouped_m16"}
    assert paths["by_pair_gemv"].gemv and paths["by_pair_gemv"].down_by_token
    assert paths["by_pair"].down_by_token and not paths["by_pair_split"].down_by_token
    # 4096 tokens x 8 over 128 experts: 256 rows an expert, every block size worth timing.
    grouped = paths_for(qwen, 4096, 132)
    assert set(grouped) == {f"grouped_m{m}" for m in (16, 32, 64, 128)}
    assert all(t.block_m == int(name[9:]) and not t.by_pair for name, t in grouped.items())


def test_moe_sweep_is_coordinate_descent_over_gate_up_then_down():
    from ember.bench.tune_moe import STREAM_CANDIDATES, candidates, sweep_path, tiles_key
    from ember.kernels.moe_tiles import MoeShape, default_moe_tiles

    start = default_moe_tiles(MoeShape(8, 1024, 512, 2), 1)
    target_gate_up, target_down = candidates(start)[2], candidates(start)[4]

    def measure(tiles):  # fastest at the target tiles; 64-column gate/up tiles fail
        if tiles.gate_up.block_n == 64:
            return "OutOfResources: shared memory"
        return 10.0 - (tiles.gate_up == target_gate_up) - (tiles.down == target_down)

    best, times = sweep_path(measure, start, MoeShape(8, 1024, 512, 2))
    assert (best.gate_up, best.down) == (target_gate_up, target_down)
    assert len(times) <= 1 + 2 * len(STREAM_CANDIDATES)
    assert sum(isinstance(us, str) for us in times.values()) == 2  # both 64-column candidates
    assert tiles_key(start) in times


def test_mxfp4_sweep_tries_each_product_decoding_in_registers():
    """After the tile sweep, an MXFP4 path times each product's best decoding in registers
    and keeps it where faster (here down's only); the GEMV path has no such choice."""
    from ember.bench.tune_moe import MOE_SHAPES, paths_for, sweep_path

    shape = MOE_SHAPES["gpt-oss-20b-mxfp4"]
    paths = paths_for(shape, 1, 132)

    def measure(tiles):
        return 10.0 - tiles.down.mxfp4_in_registers + tiles.gate_up.mxfp4_in_registers

    best, times = sweep_path(measure, paths["by_pair"], shape)
    assert best.down.mxfp4_in_registers and not best.gate_up.mxfp4_in_registers
    assert sum("regs" in key for key in times) == 2
    _, gemv_times = sweep_path(measure, paths["by_pair_gemv"], shape)
    assert not any("regs" in key for key in gemv_times)
    grouped, _ = sweep_path(lambda t: 1.0, paths["grouped_m16"], MOE_SHAPES["gpt-oss-20b"])
    assert not grouped.down.mxfp4_in_registers  # bf16 experts: no decode to choose


def test_moe_table_reads_back_into_the_tuning():
    from ember.bench.tune_moe import MOE_SHAPES
    from ember.kernels.moe_tiles import MeasuredMoeTiles, MoeTuning, default_moe_tiles
    from ember.kernels.tuning_files import measured_as_dict, measured_rows

    shape = MOE_SHAPES["gpt-oss-20b"]
    tiles = default_moe_tiles(shape, 300)
    table = [measured_as_dict(MeasuredMoeTiles(shape, 8, tiles))]
    tuning = MoeTuning().with_measured(*measured_rows(json.loads(json.dumps(table))))
    assert tuning.tiles_for(shape, 5) == tiles != default_moe_tiles(shape, 5)


@pytest.mark.parametrize("tokens", [3, 40])
def test_every_swept_moe_tiling_computes_the_reference(tokens):
    """Each candidate the moe sweep times runs the kernels to the reference's result (Triton's
    interpreter on the CPU, a tiny expert shape)."""
    from helpers.moe_reference import moe_reference, moe_weights, routing

    from ember.bench.tune_moe import paths_for, sweep_path
    from ember.kernels.fused_moe import fused_moe
    from ember.kernels.moe_tiles import MoeShape

    shape = MoeShape(6, 64, 32, 2, elem_bytes=4)
    gen = torch.Generator().manual_seed(tokens)
    weights = moe_weights(6, 64, 32, gen, bias=True)
    x = torch.randn(tokens, 64, generator=gen)
    topk_ids, topk_weights = routing("random", tokens, 6, 2, gen)
    expected = moe_reference(x, **weights, topk_weights=topk_weights, topk_ids=topk_ids)
    ran = []

    def measure(tiles):
        out = fused_moe(x, **weights, topk_weights=topk_weights, topk_ids=topk_ids, tiles=tiles)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
        ran.append(tiles)
        return 1.0

    paths = paths_for(shape, tokens, num_sms=132)
    for tiles in paths.values():
        sweep_path(measure, tiles, shape)
    assert any(t.by_pair for t in ran) == (tokens <= 16)
    assert len({t.block_m for t in ran}) == len({t.block_m for t in paths.values()})


def test_mxfp4_moe_shapes_sweep_whole_scale_groups_and_count_packed_bytes():
    """The -mxfp4 shapes' paths and candidates step K by whole 32-value groups; their floor
    counts each chosen expert's packed bytes and scales, 17/64 of bf16's."""
    from ember.bench.tune_moe import MOE_SHAPES, candidates, paths_for, selected_bytes
    from ember.kernels.moe_tiles import MXFP4_GROUP

    packed, plain = MOE_SHAPES["gpt-oss-20b-mxfp4"], MOE_SHAPES["gpt-oss-20b"]
    assert packed._replace(mxfp4=False) == plain
    for tokens in (1, 64, 4096):
        for tiles in paths_for(packed, tokens, 132).values():
            swept = [tiles.gate_up, tiles.down, *candidates(tiles, narrow_weights=True)]
            assert all(gemm.block_k % MXFP4_GROUP == 0 for gemm in swept)
    ids = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 4]], dtype=torch.int32)  # five experts chosen
    x_bytes = 2 * 2 * 2880 * 2
    assert selected_bytes(packed, ids) - x_bytes == 5 * 3 * 2880 * 2880 * 17 // 32
    assert selected_bytes(plain, ids) - x_bytes == 5 * 3 * 2880 * 2880 * 2


def test_fp8_moe_shapes_sweep_fp8_experts_with_longer_k_steps_and_count_one_byte():
    """The -fp8 shapes: `expert_weights` quantizes each expert's rows to e4m3 (`Fp8Weight`),
    the stream candidates take the longer K steps, the floor counts a byte an element, and a
    table row written for one reads back as its own (`MoeShape.fp8`); a row written before
    the field existed reads back as a bf16 one."""
    from ember.bench.tune_moe import (
        LONG_K_STREAM_CANDIDATES,
        MOE_SHAPES,
        candidates,
        expert_weights,
        paths_for,
        selected_bytes,
    )
    from ember.kernels.moe_tiles import MeasuredMoeTiles, MoeShape
    from ember.kernels.tuning_files import measured_as_dict, measured_rows
    from ember.layers.fp8 import Fp8Weight

    quantized = MOE_SHAPES["qwen3-30b-a3b-fp8"]
    assert quantized._replace(fp8=False) == MOE_SHAPES["qwen3-30b-a3b"]
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int32)
    x_bytes = 2 * 1 * 2048 * 2
    assert selected_bytes(quantized, ids) - x_bytes == 8 * 3 * 2048 * 768
    stream = paths_for(quantized, 1, 132)["by_pair"]
    long_k = [(g.block_n, g.block_k, g.stages, g.num_warps) for g in candidates(stream, True)]
    assert set(LONG_K_STREAM_CANDIDATES) <= set(long_k)
    small = MoeShape(4, 64, 32, 2, fp8=True)
    weights = expert_weights(small, device="cpu")
    for name, rows, cols in (("w13", 64, 64), ("w2", 64, 32)):
        weight = weights[name]
        assert isinstance(weight, Fp8Weight) and weight.weight.dtype == torch.float8_e4m3fn
        assert weight.weight.shape == (4, rows, cols) and weight.scale.shape == (4, rows)
    tiles = paths_for(small, 1, 132)["by_pair"]
    (row,) = measured_rows([measured_as_dict(MeasuredMoeTiles(small, 1, tiles))])
    assert row.shape == small
    written_before = measured_as_dict(MeasuredMoeTiles(small, 1, tiles))
    del written_before["shape"]["fp8"]
    assert measured_rows([written_before])[0].shape == small._replace(fp8=False)


@pytest.mark.parametrize("weights_format", ["mxfp4", "fp8"])
@pytest.mark.parametrize("tokens", [3, 40])
def test_every_swept_quantized_moe_tiling_computes_the_reference(tokens, weights_format):
    """The moe sweep over MXFP4 or FP8 experts (`expert_weights` of an -mxfp4 or -fp8 shape,
    on the CPU): each candidate, the longer K steps included, runs the kernels to the float64
    loop's result on the dequantized weights."""
    from helpers.moe_reference import moe_reference, routing

    from ember.bench.tune_moe import expert_weights, paths_for, sweep_path
    from ember.kernels.fused_moe import fused_moe
    from ember.kernels.moe_tiles import MoeShape
    from ember.layers.fp8 import Fp8Weight, dense_weight
    from ember.layers.mxfp4 import Mxfp4Weight

    shape = MoeShape(6, 64, 96, 2, elem_bytes=4, **{weights_format: True})
    weights = expert_weights(shape, seed=tokens, device="cpu")
    kind = Mxfp4Weight if shape.mxfp4 else Fp8Weight
    assert all(isinstance(w, kind) for w in weights.values())
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=gen)
    topk_ids, topk_weights = routing("random", tokens, 6, 2, gen)
    dense = {
        name: w.dequantize(torch.float64) if shape.mxfp4 else dense_weight(w, torch.float64)
        for name, w in weights.items()
    }
    expected = moe_reference(x, **dense, topk_weights=topk_weights, topk_ids=topk_ids)
    ran = []

    def measure(tiles):
        out = fused_moe(x, **weights, topk_weights=topk_weights, topk_ids=topk_ids, tiles=tiles)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
        ran.append(tiles)
        return 1.0

    for tiles in paths_for(shape, tokens, num_sms=132).values():
        sweep_path(measure, tiles, shape)
    assert any(t.by_pair for t in ran) == (tokens <= 16)
    assert any(t.gate_up.block_k == 512 for t in ran)  # the longer steps, fitted
