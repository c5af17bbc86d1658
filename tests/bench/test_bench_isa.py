"""`ember bench isa`: the fused MoE's kernels compiled for sm_90 on the CPU, through the same
launches the engine makes, and their loops read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the benchmarks' tooling: whole runs, not the engine


def test_compiling_offline_refuses_interpreted_kernels():
    from ember.bench.offline_compile import compile_offline
    from ember.kernels.compile_ahead import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("kernels are compiled in this process")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0"), compile_offline(90):
        pass


def test_the_gemv_path_compiles_as_its_tiles_say_and_its_loops_read_back(tmp_path):
    from ember.bench.tune_moe import MOE_SHAPES, paths_for

    out = tmp_path / "isa.json"
    command = [sys.executable, "-m", "ember.cli", "bench", "isa"]
    options = ["--moe-tokens", "1", "--paths", "by_pair_gemv", "--output-json", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # interpreted kernels cannot be compiled
    done = subprocess.run(
        command + options, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    [row] = report["rows"]
    assert (report["arch"], row["path"], row["tokens"], row["heuristic"]) == (
        90,
        "by_pair_gemv",
        1,
        True,
    )
    tiles = paths_for(MOE_SHAPES["gpt-oss-20b-mxfp4"], 1, report["num_sms"])["by_pair_gemv"]
    kernels = {k["kernel"]: k for k in row["kernels"]}
    assert set(kernels) == {"_gate_up_gemv_kernel", "_down_gemv_kernel"}
    for name, gemm in (("_gate_up_gemv_kernel", tiles.gate_up), ("_down_gemv_kernel", tiles.down)):
        kernel = kernels[name]
        constants = kernel["constants"]
        assert (constants["BLOCK_N"], constants["BLOCK_K"]) == (gemm.block_n, gemm.block_k)
        assert constants["W_FORMAT"] == 2  # MXFP4 decoded on the CUDA cores
        assert kernel["num_warps"] == gemm.num_warps and kernel["registers"] > 0
        streams = 2 if name == "_gate_up_gemv_kernel" else 1
        values = streams * gemm.block_n * gemm.block_k / (gemm.num_warps * 32)
        hot = max(kernel["loops"], key=lambda loop: loop["instructions"])
        assert hot["values_per_thread"] == values
        assert hot["per_value"] == round(hot["instructions"] / values, 2)
        assert "FFMA" in {opcode for opcode, _ in hot["mix"]}  # the GEMV's products
        assert row["per_value"][name] == hot["per_value"]


def test_fp8_weights_widened_in_registers_leave_the_conversion_units_out(tmp_path):
    """The skinny GEMM's K loop over each layer of a tiny model, compiled for sm_90: over bf16
    weights no conversion; over FP8 ones, Triton's widening converts (e4m3 pairs to fp16, then
    fp16 to bf16, 1.5 a weight value); widened in registers, none again."""
    out = tmp_path / "isa.json"
    command = [sys.executable, "-m", "ember.cli", "bench", "isa", "--sections", "linear"]
    options = ["--preset", "tiny", "--rows", "1", "--output-json", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        command + options, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["linear"]
    assert {row["weights"] for row in rows} == {"bf16", "fp8", "fp8_in_registers"}
    assert {row["layer"] for row in rows} == {"qkv", "o", "gate_up", "down", "lm_head"}
    for row in rows:
        [kernel] = row["kernels"]
        hot = max(kernel["loops"], key=lambda loop: loop["instructions"])
        if row["weights"] == "fp8":
            assert hot["conversions_per_value"] >= 1, row
        else:
            assert hot["conversions"] == 0, row
        if row["weights"] == "fp8_in_registers":
            assert kernel["constants"]["FP8_IN_REGISTERS"] is True


def test_an_fp8_caches_tiles_widened_in_ptx_leave_the_conversion_units_out(tmp_path):
    """The paged attention's KV loops, compiled for sm_90 as `compile_check` launches them:
    over an FP8 cache Triton's widening converts each K and V value (1.5 conversions a value),
    the PTX one does not (none but the few a bf16 cache's loop has too)."""
    out = tmp_path / "isa.json"
    command = [sys.executable, "-m", "ember.cli", "bench", "isa", "--sections", "attention"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [*command, "--output-json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["attention"]
    by_form = {form: [r for r in rows if r["kv_fp8"] == form] for form in (0, 1, 2)}
    assert all(by_form.values()) and len(by_form[1]) == len(by_form[2])
    for converted, in_ptx in zip(by_form[1], by_form[2], strict=True):
        assert in_ptx["case"] == f"{converted['case']}, ptx widen"
        assert converted["conversions_per_kv_value"] >= 1.5
        bf16 = next(r for r in by_form[0] if r["case"] == converted["case"].split(", fp8")[0])
        assert in_ptx["conversions_per_kv_value"] == bf16["conversions_per_kv_value"]
