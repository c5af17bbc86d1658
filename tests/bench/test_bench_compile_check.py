"""The engine's kernels compiled for an H200 (sm_90) on the CPU: every default configuration and
planned launch fits an SM's shared memory, and the check catches one that does not (the CPU
interpreter cannot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the benchmarks' tooling: whole runs, not the engine

_OVERSIZE = """
import json
from ember.bench.compile_check import skinny_gemm_config

config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "STAGES": 6, "num_warps": 4}
print(json.dumps(skinny_gemm_config("qkv", 64, config).shared_bytes))
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    # Interpreted kernels cannot be compiled: the check runs in a process of its own.
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, check=False
    )


def test_every_default_configuration_fits_an_h200():
    from ember.bench.compile_check import SM90_SHARED_MEMORY_LIMIT

    done = _run("-m", "ember.bench.compile_check", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    cases = {(r["kernel"], r["case"]) for r in results}
    assert ("skinny_gemm", "gate_up m=1") in cases and ("stream_k_gemm", "gate_up m=128") in cases
    # The fused MoE on each path its default table takes (by pair at T=1 and 4, its down per
    # pair at 1 and per token at 4; grouped past it).
    for case in ("gpt-oss-20b T=1", "qwen3-30b-a3b T=4096"):
        assert ("gate_up_kernel", case) in cases
    assert ("down_kernel", "qwen3-30b-a3b T=1") in cases
    assert ("down_by_token_kernel", "qwen3-30b-a3b T=4") in cases
    assert ("down_kernel", "gpt-oss-20b T=4096") in cases
    for kernel in ("gate_up_kernel", "down_kernel"):  # FP8 experts, widened to bf16
        assert (kernel, "qwen3-30b-a3b T=1, fp8 experts") in cases
        assert (kernel, "llama-4-scout-fp8 T=4096, fp8 experts") in cases
    # ... in PTX, as the engine's tables launch them by default (W_FP8_PTX).
    fp8_experts = [r for r in results if r["case"].endswith("fp8 experts")]
    assert {r["constexprs"].get("W_FORMAT") for r in fp8_experts} - {None} == {5}
    assert ("down_kernel", "gpt-oss-20b T=4096, fp8 experts") in cases
    # MXFP4 experts: the GEMV at a decode's token counts, tl.dot_scaled past them.
    for tokens in (1, 4):
        assert ("gate_up_gemv_kernel", f"gpt-oss-120b-mxfp4 T={tokens}") in cases
        assert ("down_gemv_kernel", f"gpt-oss-20b-mxfp4 T={tokens}") in cases
    for tokens in (16, 4096):
        assert ("gate_up_kernel", f"gpt-oss-120b-mxfp4 T={tokens}") in cases
    assert ("down_kernel", "gpt-oss-20b-mxfp4 T=4096") in cases
    # MXFP4 decoded in PTX (the tiles' mxfp4_in_registers), by pair at one token and grouped:
    # the products compile for sm_90.
    for tokens in (1, 4096):
        assert ("gate_up_kernel", f"gpt-oss-120b-mxfp4 T={tokens}, ptx decode") in cases
    assert ("down_kernel", "gpt-oss-20b-mxfp4 T=1, ptx decode") in cases
    # Compiled from fused_moe's own launches: the alignment where the grouped path runs it
    # (torch's sort past its pairs) and the sum over k where down runs per pair.
    assert ("align_kernel", "qwen3-30b-a3b T=16") in cases
    assert ("align_kernel", "qwen3-30b-a3b T=4096") not in cases
    assert ("sum_over_top_k_kernel", "gpt-oss-20b T=1") in cases
    assert ("sum_over_top_k_kernel", "gpt-oss-20b T=4") not in cases  # down by token
    assert ("skinny_gemm", "gate_up m=64, fp8 weights") in cases  # FP8 tiles, widened to bf16
    # The attention kernel as the planner launches it, its heaviest variants among them.
    attention = {r["case"]: r["constexprs"] for r in results if r["kernel"] == "paged_attention"}
    launches = {"decode split", "decode", "decode, full grid", "mixed decodes", "mixed chunks"}
    # Each over a bf16 cache and over an FP8 one; windows, chunks, sinks, NoPE and the QK norms
    # on bf16.
    variants = {
        "decode split, window, sinks, QK L2 norm",
        "decode split, QK RMSNorm",
        "decode, chunks, NoPE",
        "mixed chunks, window, sinks",
    }
    fp8 = {f"{case}, fp8 kv" for case in launches} | {f"{c}, fp8 kv, ptx widen" for c in launches}
    assert set(attention) == launches | fp8 | variants
    switches = ("SPLIT_KV", "ROPE", "PRELOAD_KV", "TILE_MAP", "KV_FP8", "KEY_START", "SINKS")
    for switch in (*switches, "QK_RMS_NORM", "QK_L2_NORM"):
        assert any(constexprs[switch] for constexprs in attention.values()), switch
    for r in results:
        assert r["shared_bytes"] <= SM90_SHARED_MEMORY_LIMIT and r["fits"], r
        # Every kernel stages tiles in shared memory but the sum over k, an elementwise pass.
        assert r["shared_bytes"] > 0 or r["kernel"] == "sum_over_top_k_kernel", r
    # The pipelined tiles are what take the room: a wider step asks more.
    by_case = {r["case"]: r["shared_bytes"] for r in results}
    assert by_case["gate_up m=64"] > by_case["o m=1"]
    # An FP8 cache's K/V tiles are staged as stored: half the bytes of bf16's.
    assert by_case["mixed chunks, fp8 kv"] < by_case["mixed chunks"]


def test_the_check_catches_tiles_too_big_for_an_sm():
    from ember.bench.compile_check import SM90_SHARED_MEMORY_LIMIT

    done = _run("-c", _OVERSIZE)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) > SM90_SHARED_MEMORY_LIMIT
