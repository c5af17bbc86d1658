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


_SKINNY_FP8_LOOPS = """
import json, torch
from ember.bench.offline_compile import compile_offline
from ember.bench.sass import disassemble, loops
from ember.kernels.skinny_gemm import skinny_gemm
from ember.layers.fp8 import FP8_DTYPE, Fp8Weight

weight = Fp8Weight(torch.empty(4096, 4096, dtype=FP8_DTYPE), torch.empty(4096))
x = torch.empty(1, 4096, dtype=torch.bfloat16)
opcodes = {}
for in_registers in (False, True):
    with compile_offline(90) as compiled:
        skinny_gemm(x, weight, fp8_widen_in_registers=in_registers)
    [kernel] = compiled
    body = max(loops(disassemble(kernel.cubin)), key=lambda loop: len(loop.body)).body
    opcodes[str(in_registers)] = sorted({i.opcode for i in body})
print(json.dumps(opcodes))
"""


def test_fp8_weights_widened_in_registers_leave_the_conversion_units_out():
    """The skinny GEMM's K loop over an FP8 weight, compiled for sm_90: Triton's widening
    converts (e4m3 pairs to fp16, then fp16 to bf16); the bit form takes none of those."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _SKINNY_FP8_LOOPS],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    opcodes = json.loads(done.stdout.strip().splitlines()[-1])
    conversions = {"F2F.BF16.F16", "F2FP.F16.E4M3.UNPACK_B"}
    assert conversions <= set(opcodes["False"])
    assert not any(op.startswith(("F2F", "I2F")) for op in opcodes["True"]), opcodes["True"]
    assert "HMUL2.BF16_V2" in opcodes["True"]  # the multiply by 2^120, two values at a time
    assert any(op.startswith("HMMA") for op in opcodes["True"])  # still the tensor cores
