"""Compile the engine's Triton kernels for an H200 on a machine without a GPU: shared memory per
launch configuration, before any device time is spent.

Triton's CPU interpreter has no shared-memory limit, so a tile configuration that outgrows an
SM passes every CPU test and fails only when the GPU launches it (a stream-K GEMM's 256-wide K
steps at 64 rows asked 256 KiB and cost a device call). Triton's compiler itself runs without a
device: this compiles each kernel as the engine launches it (its default tiles for the
Llama-3.1-8B shapes; pointers and sizes divisible by 16, as Triton specializes them at launch)
for sm_90 and reads the shared memory the compiled kernel asks for.

    TRITON_INTERPRET=0 python -m ember.bench.compile_check [--json]

Exits 1 if a configuration does not fit. Needs ``TRITON_INTERPRET=0`` (interpreted kernels
cannot be compiled) and Triton's bundled ``ptxas``; about 1-2 s per configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

# An sm_90 block's shared memory ceiling (opt-in), as Triton reports it on an H200.
SM90_SHARED_MEMORY_LIMIT = 232448

# The checkpoint preset whose decode GEMMs (`ember.bench.tune.linear_shapes`) are compiled.
_PRESET = "llama-3.1-8b"
# The fused gate/up: its epilogue applies SiLU-and-multiply.
_GATED_SHAPE = "gate_up"
# Row counts at which the skinny GEMM's default tiles change (see its default_config).
_GEMM_ROWS = (1, 16, 32, 64)


@dataclass(frozen=True)
class CompiledConfig:
    kernel: str
    case: str
    constexprs: dict
    num_warps: int
    shared_bytes: int

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SM90_SHARED_MEMORY_LIMIT


def compile_for_sm90(kernel, types: dict[str, str], divisible: set[str], constexprs: dict,
                     num_warps: int) -> int:  # fmt: skip
    """Shared bytes of ``kernel`` compiled for sm_90 with these argument ``types`` (names not
    given are i32), ``constexprs``, and 16-divisibility on the ``divisible`` arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        raise TypeError("kernels are interpreted (TRITON_INTERPRET=1): set it to 0 to compile")
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in divisible}
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    return compiled.metadata.shared


def skinny_gemm_config(name: str, m: int, config: dict[str, int]) -> CompiledConfig:
    """The skinny GEMM as the engine launches it for the projection ``name`` at ``m`` rows,
    on ``config`` (its tiles)."""
    from ember.kernels.skinny_gemm import _skinny_gemm_kernel

    gated = name == _GATED_SHAPE
    config = dict(config)
    num_warps = config.pop("num_warps")
    row_norm = name in ("qkv", "gate_up")  # the deferred RMSNorm's readers
    constexprs = {
        "HAS_BIAS": False, "ADD_TO_OUT": name in ("o", "down"), "GATED": gated,
        "ROW_NORM": row_norm, "BLOCK_P": 128 if row_norm else 16, "EVEN_K": True,
        "DOT_PRECISION": "tf32", "PDL": True, **config,
    }  # fmt: skip
    pointers = ("x_ptr", "w_ptr", "bias_ptr", "out_ptr")
    types = {**{p: "*bf16" for p in pointers}, "parts_ptr": "*fp32", "norm_parts_ptr": "*fp32",
             "eps": "fp32"}  # fmt: skip
    divisible = {*pointers, "parts_ptr", "norm_parts_ptr", "N", "K", "stride_xm", "stride_wn",
                 "stride_om"}  # fmt: skip
    shared = compile_for_sm90(_skinny_gemm_kernel, types, divisible, constexprs, num_warps)
    return CompiledConfig("skinny_gemm", f"{name} m={m}", constexprs, num_warps, shared)


def skinny_gemm_configs() -> list[CompiledConfig]:
    """Every 8B projection at each row count where its default tiles change."""
    from ember.bench.tune import linear_shapes
    from ember.kernels.skinny_gemm import default_config

    return [
        skinny_gemm_config(name, m, default_config(m, n, k, 2, gated=name == _GATED_SHAPE))
        for name, n, k in linear_shapes(_PRESET)
        for m in _GEMM_ROWS
    ]


def stream_k_gemm_configs() -> list[CompiledConfig]:
    """The stream-K GEMM as the engine launches it: the 8B gate/up, gated, at 128 rows (its
    default tiles read through TMA descriptors)."""
    from ember.bench.tune import linear_shapes
    from ember.kernels.stream_k_gemm import _stream_k_gemm_kernel, default_config

    n, k = next((n, k) for name, n, k in linear_shapes(_PRESET) if name == _GATED_SHAPE)
    config = default_config(128, n, k, gated=True)
    num_warps = config.pop("num_warps")
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    constexprs = {"GATED": True, "PDL": False, **config}
    types = {"x_desc": f"tensordesc<bf16[{block_m},{block_k}]>",
             "w_desc": f"tensordesc<bf16[{block_n // 2},{block_k}]>", "out_ptr": "*bf16",
             "partials_ptr": "*fp32", "counters_ptr": "*i32"}  # fmt: skip
    divisible = {"out_ptr", "partials_ptr", "counters_ptr", "stride_om"}
    shared = compile_for_sm90(_stream_k_gemm_kernel, types, divisible, constexprs, num_warps)
    return [CompiledConfig("stream_k_gemm", "gate_up m=128", constexprs, num_warps, shared)]


def attention_configs() -> list[CompiledConfig]:
    """The paged attention's launches for the 8B shape (GQA 4, head 128, bf16): decode split
    and unsplit (with RoPE, the deferred norm and the K/V preload: the most state a program
    holds), prefill tiles for all sequences, and a mixed step's two launches (its decodes on
    decode tiles, long ones in segments; its chunks on prefill tiles over the chunk tile map)."""
    from ember.kernels.attention_plan import (
        MAX_SPLITS,
        MIXED_DECODE_SPLITS,
        ONE_WARP_MIN_PROGRAMS_PER_SM,
        tile_config,
    )
    from ember.kernels.paged_attention import (
        _ALL_SEQUENCES,
        _MULTI_TOKEN,
        _SINGLE_TOKEN,
        _paged_attention_kernel,
    )

    pointers = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "rope_k_ptr", "rope_v_ptr")
    int_pointers = ("query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr",
                    "split_counters_ptr", "positions_ptr", "slot_mapping_ptr",
                    "chunk_tiles_ptr")  # fmt: skip
    fp32_pointers = ("part_max_ptr", "part_sum_ptr", "part_acc_ptr", "cos_sin_ptr", "parts_ptr")
    types = {**{p: "*bf16" for p in pointers}, **{p: "*i32" for p in int_pointers},
             **{p: "*fp32" for p in fp32_pointers}, "eps": "fp32", "qk_scale": "fp32"}  # fmt: skip
    # Every stride is a multiple of 16 elements in the 8B shape, and Triton specializes on it:
    # without stride_cache_head the K/V loads compiled as plain loads (22 KiB for a decode tile)
    # where launches pipeline them through shared memory (38 KiB).
    divisible = {*pointers, *int_pointers, *fp32_pointers, "stride_q_tok", "stride_q_head",
                 "stride_o_tok", "stride_o_head", "stride_cache_block", "stride_cache_slot",
                 "stride_cache_head", "stride_table", "stride_rk_tok", "stride_rk_head",
                 "stride_rv_tok", "stride_rv_head"}  # fmt: skip
    results = []
    # (case, decode tiles, their split configuration, programs per SM, segments, sequences
    # served, tile map)
    full = ONE_WARP_MIN_PROGRAMS_PER_SM
    cases = (("decode split", True, True, 0, MAX_SPLITS, _ALL_SEQUENCES, False),
             ("decode", True, False, 0, 1, _ALL_SEQUENCES, False),
             ("decode, full grid", True, False, full, 1, _ALL_SEQUENCES, False),
             ("prefill", False, False, 0, 1, _ALL_SEQUENCES, False),
             ("mixed decodes", True, False, 0, MIXED_DECODE_SPLITS, _SINGLE_TOKEN, False),
             ("mixed chunks", False, False, 0, 1, _MULTI_TOKEN, True))  # fmt: skip
    for case, decode, split_tiles, per_sm, splits, sequences, tile_map in cases:
        sequences = sequences.value
        rope = decode and sequences == _ALL_SEQUENCES.value  # a mixed step writes its cache first
        config = tile_config(4, decode, 128, 2, split_tiles, per_sm)
        num_warps = config.pop("num_warps")
        constexprs = {
            "GROUP": 4, "HEAD_DIM": 128, "PAGE": 16, "DECODE_ONLY": decode,
            "SPLIT_KV": splits > 1, "DOT_PRECISION": "tf32", "BLOCK_SPLITS": splits,
            "GROUP_P2": 4, "MERGE_CHUNK": min(8, splits), "ROPE": rope, "ROW_NORM": rope,
            "BLOCK_P": 128, "PDL": True, "PRELOAD_KV": rope and split_tiles,
            "SEQUENCES": sequences, "TILE_MAP": tile_map, **config,
        }  # fmt: skip
        shared = compile_for_sm90(_paged_attention_kernel, types, divisible, constexprs, num_warps)
        results.append(CompiledConfig("paged_attention", case, constexprs, num_warps, shared))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON list on stdout")
    args = parser.parse_args(argv)
    results = skinny_gemm_configs() + stream_k_gemm_configs() + attention_configs()
    if args.json:
        print(json.dumps([{**asdict(r), "fits": r.fits} for r in results]))
    else:
        for r in results:
            verdict = "fits" if r.fits else "DOES NOT FIT"
            print(f"{r.kernel:16} {r.case:18} {r.shared_bytes / 1024:6.0f} KiB  {verdict}")
        print(f"limit {SM90_SHARED_MEMORY_LIMIT / 1024:.0f} KiB per block (sm_90)")
    return 0 if all(r.fits for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
