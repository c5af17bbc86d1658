"""Compile the engine's Triton kernels for an H200 on a machine without a GPU: shared memory per
launch configuration, before any device time is spent.

Triton's CPU interpreter has no shared-memory limit, so a tile configuration that outgrows an
SM passes every CPU test and fails only when the GPU launches it. Triton's compiler itself runs
without a device: this compiles each kernel as the engine launches it (its default tiles and
planned launches for the Llama-3.1-8B shapes; pointers and sizes divisible by 16, as Triton
specializes them at launch; the fused MoE through its own launches, `ember.bench.offline_compile`)
for sm_90 and reads the shared memory the compiled kernel asks for.

    TRITON_INTERPRET=0 python -m ember.bench.compile_check [--json]

Exits 1 if a configuration does not fit. Needs ``TRITON_INTERPRET=0`` (interpreted kernels
cannot be compiled) and Triton's bundled ``ptxas``; about 1-2 s per configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, replace

# An sm_90 block's shared memory ceiling (opt-in), as Triton reports it on an H200.
SM90_SHARED_MEMORY_LIMIT = 232448

# The checkpoint preset whose decode GEMMs (`ember.bench.tune.linear_shapes`) are compiled.
_PRESET = "llama-3.1-8b"
# The fused gate/up: its epilogue applies SiLU-and-multiply.
_GATED_SHAPE = "gate_up"
# Row counts at which the skinny GEMM's default tiles change (see its default_config).
_GEMM_ROWS = (1, 16, 32, 64)
# Of those, the ones compiled over FP8 weights too (the same tiles; the fewest and most rows).
_FP8_GEMM_ROWS = (1, 64)


@dataclass(frozen=True)
class CompiledConfig:
    kernel: str
    case: str
    constexprs: dict
    num_warps: int
    shared_bytes: int
    # The compiled machine code, for `ember bench isa` (empty where not kept).
    cubin: bytes = field(default=b"", repr=False, compare=False)

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SM90_SHARED_MEMORY_LIMIT


def compile_for_sm90(
    kernel, types: dict[str, str], divisible: set[str], constexprs: dict, num_warps: int
) -> tuple[int, bytes]:
    """Shared bytes and cubin of ``kernel`` compiled for sm_90 with these argument ``types``
    (names not given are i32), ``constexprs``, and 16-divisibility on the ``divisible``
    arguments."""
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
    return compiled.metadata.shared, compiled.asm["cubin"]


def skinny_gemm_config(
    name: str, m: int, config: dict[str, int], fp8: bool = False
) -> CompiledConfig:
    """The skinny GEMM as the engine launches it for the projection ``name`` at ``m`` rows,
    on ``config`` (its tiles); ``fp8``: over an FP8 weight and its row scales."""
    from ember.kernels.skinny_gemm import _skinny_gemm_kernel

    gated = name == _GATED_SHAPE
    config = dict(config)
    num_warps = config.pop("num_warps")
    row_norm = name in ("qkv", "gate_up")  # the deferred RMSNorm's readers
    constexprs = {
        "HAS_BIAS": False,
        "W_SCALED": fp8,
        "ADD_TO_OUT": name in ("o", "down"),
        "GATED": gated,
        "ROW_NORM": row_norm,
        "BLOCK_P": 128 if row_norm else 16,
        "EVEN_K": True,
        "DOT_PRECISION": "tf32",
        "PDL": True,
        # FP8: widened in PTX (`--fp8-widen-in-registers`; its staged tiles, what this checks,
        # are the conversions' too), so the inline assembly is compiled here as well.
        "FP8_IN_REGISTERS": fp8,
        **config,
    }
    pointers = ("x_ptr", "w_ptr", "bias_ptr", "out_ptr")
    types = {
        **{p: "*bf16" for p in pointers},
        "w_ptr": "*fp8e4nv" if fp8 else "*bf16",
        "w_scale_ptr": "*fp32",
        "parts_ptr": "*fp32",
        "norm_parts_ptr": "*fp32",
        "eps": "fp32",
    }
    divisible = {
        *pointers,
        "w_scale_ptr",
        "parts_ptr",
        "norm_parts_ptr",
        "N",
        "K",
        "stride_xm",
        "stride_wn",
        "stride_om",
    }
    shared, cubin = compile_for_sm90(_skinny_gemm_kernel, types, divisible, constexprs, num_warps)
    case = f"{name} m={m}" + (", fp8 weights" if fp8 else "")
    return CompiledConfig("skinny_gemm", case, constexprs, num_warps, shared, cubin)


def skinny_gemm_configs() -> list[CompiledConfig]:
    """Every 8B projection at each row count where its default tiles change, and over FP8
    weights (which take the bf16 tiles) at the fewest and the most rows."""
    from ember.bench.tune import linear_shapes
    from ember.kernels.skinny_gemm import default_config

    return [
        skinny_gemm_config(name, m, default_config(m, n, k, 2, gated=name == _GATED_SHAPE), fp8)
        for fp8, rows in ((False, _GEMM_ROWS), (True, _FP8_GEMM_ROWS))
        for name, n, k in linear_shapes(_PRESET)
        for m in rows
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
    types = {
        "x_desc": f"tensordesc<bf16[{block_m},{block_k}]>",
        "w_desc": f"tensordesc<bf16[{block_n // 2},{block_k}]>",
        "out_ptr": "*bf16",
        "partials_ptr": "*fp32",
        "counters_ptr": "*i32",
    }
    divisible = {"out_ptr", "partials_ptr", "counters_ptr", "stride_om"}
    shared, cubin = compile_for_sm90(_stream_k_gemm_kernel, types, divisible, constexprs, num_warps)
    return [CompiledConfig("stream_k_gemm", "gate_up m=128", constexprs, num_warps, shared, cubin)]


# Layers that attend otherwise (docs/CONTRACTS.md, "Windows, sinks, chunks"), compiled on a bf16
# cache: (the launch they ride, their case name, their constexprs).
_ATTENTION_VARIANTS = (
    (
        "decode split",
        "decode split, window, sinks, QK L2 norm",
        {"KEY_START": 1, "SINKS": True, "QK_L2_NORM": True},
    ),
    ("decode split", "decode split, QK RMSNorm", {"QK_RMS_NORM": True}),
    ("decode", "decode, chunks, NoPE", {"KEY_START": 2, "ROTATE": False}),
    ("mixed chunks", "mixed chunks, window, sinks", {"KEY_START": 1, "SINKS": True}),
)
_PLAIN_LAYER = {
    "KEY_START": 0,
    "SINKS": False,
    "ROTATE": True,
    "QK_RMS_NORM": False,
    "QK_L2_NORM": False,
}


def attention_configs() -> list[CompiledConfig]:
    """The paged attention's launches (`_attention_configs`) on a bf16 cache and on an FP8 one
    (its tiles widened by Triton's conversions, and in PTX), and the variants of windowed,
    chunked, sink and NoPE layers on bf16."""
    return (
        _attention_configs(kv_fp8=False)
        + _attention_configs(kv_fp8=True)
        + _attention_configs(kv_fp8=True, widen_in_ptx=True)
    )


def _attention_configs(kv_fp8: bool, widen_in_ptx: bool = False) -> list[CompiledConfig]:
    """The paged attention's launches as `AttentionPlanner` plans them for the 8B shape (GQA 4,
    head 128, bf16) on an H200: decode steps split and unsplit (with RoPE, the deferred norm
    and, split under one wave, the K/V preload: the most state a program holds), a full grid's
    one-warp tiles, and a mixed step's two launches (its decodes on decode tiles, long ones in
    segments; its chunks on prefill tiles over the chunk tile map). ``kv_fp8``: over a float8
    e4m3 cache (its cases named ", fp8 kv"), tiles planned for its 1-byte elements;
    ``widen_in_ptx``: its tiles widened in PTX (``KV_FP8`` 2, cases named ", fp8 kv, ptx
    widen")."""
    import torch

    from ember.bench.tune import AttentionShape, attention_planner
    from ember.kernels.attention_plan import Sequences, next_power_of_2
    from ember.kernels.paged_attention import _paged_attention_kernel

    shape = AttentionShape.of(_PRESET)
    group = shape.num_q_heads // shape.num_kv_heads
    # An H200's table off CUDA.
    planner = attention_planner(shape, torch.device("cpu"), elem_bytes=1 if kv_fp8 else 2)
    # Decode steps as the engine launches them on Hopper: with PDL.
    cases = {
        "decode split": planner.plan(1, 1, 8192, pdl=True),
        "decode": planner.plan(32, 1, 512, pdl=True),
        "decode, full grid": planner.plan(256, 1, 512, pdl=True),
    }
    mixed_decodes, mixed_chunks = planner.plan(256, 512, 4096)
    cases.update({"mixed decodes": (mixed_decodes,), "mixed chunks": (mixed_chunks,)})
    pointers = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "rope_k_ptr", "rope_v_ptr")
    int_pointers = (
        "query_start_loc_ptr",
        "seq_lens_ptr",
        "block_tables_ptr",
        "split_counters_ptr",
        "positions_ptr",
        "slot_mapping_ptr",
        "chunk_tiles_ptr",
    )
    fp32_pointers = ("part_max_ptr", "part_sum_ptr", "part_acc_ptr", "cos_sin_ptr", "parts_ptr")
    types = {
        **{p: "*bf16" for p in pointers},
        **{p: "*i32" for p in int_pointers},
        **{p: "*fp32" for p in fp32_pointers},
        "sinks_ptr": "*bf16",
        "q_norm_ptr": "*bf16",
        "k_norm_ptr": "*bf16",
        "eps": "fp32",
        "rms_eps": "fp32",
        "l2_eps": "fp32",
        "qk_scale": "fp32",
    }
    # An FP8 cache's pointers and its scales; a bf16 cache passes no scales (None: constexprs).
    scales = {"k_scale": None, "v_scale": None}
    if kv_fp8:
        types.update(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv", k_scale="fp32", v_scale="fp32")
        scales = {}
    # Every stride is a multiple of 16 elements in the 8B shape, and Triton specializes on it:
    # without stride_cache_head the K/V loads compile as plain loads where launches pipeline
    # them through shared memory.
    divisible = {
        *pointers,
        *int_pointers,
        *fp32_pointers,
        "stride_q_tok",
        "stride_q_head",
        "stride_o_tok",
        "stride_o_head",
        "stride_cache_block",
        "stride_cache_slot",
        "stride_cache_head",
        "stride_table",
        "stride_rk_tok",
        "stride_rk_head",
        "stride_rv_tok",
        "stride_rv_head",
    }
    results = []
    variants = [(case, case, _PLAIN_LAYER) for case in cases]
    if not kv_fp8:
        variants += [(case, name, {**_PLAIN_LAYER, **v}) for case, name, v in _ATTENTION_VARIANTS]
    for case, name, layer in variants:
        (launch,) = cases[case]
        # RoPE and the cache write ride in a decode-only step's launch; a mixed step's come first.
        rope = launch.decode_only and launch.sequences == Sequences.ALL
        config = dict(launch.tiles)
        num_warps = config.pop("num_warps")
        constexprs = {
            "GROUP": group,
            "HEAD_DIM": shape.head_dim,
            "PAGE": shape.block_size,
            "DECODE_ONLY": launch.decode_only,
            "SPLIT_KV": launch.splits > 1,
            "DOT_PRECISION": "tf32",
            "BLOCK_SPLITS": next_power_of_2(launch.splits),
            "GROUP_P2": max(2, next_power_of_2(group)),
            "MERGE_CHUNK": min(8, next_power_of_2(launch.splits)),
            "ROPE": rope,
            "ROW_NORM": rope,
            "BLOCK_P": 128 if rope else 16,
            "PDL": True,
            "PRELOAD_KV": rope and launch.preload_kv,
            "SEQUENCES": int(launch.sequences),
            "TILE_MAP": launch.chunk_map,
            "KV_FP8": 2 if widen_in_ptx else int(kv_fp8),
            **layer,
            **scales,
            **config,
        }
        shared, cubin = compile_for_sm90(
            _paged_attention_kernel, types, divisible, constexprs, num_warps
        )
        name = f"{name}, fp8 kv" if kv_fp8 else name
        name = f"{name}, ptx widen" if widen_in_ptx else name
        config = CompiledConfig("paged_attention", name, constexprs, num_warps, shared, cubin)
        results.append(config)
    return results


# Token counts at which the fused MoE's default tiles take each path: by pair (a decode; down
# one program per pair at 1 token, per token at 4; MXFP4 experts on the GEMV), grouped on
# 16-row blocks, on tensor-core blocks (a prefill).
_MOE_TOKENS = (1, 4, 16, 4096)
# Of those, the ones compiled over FP8 experts too (the same tiles, weights widened to bf16),
# and MXFP4 ones decoded in PTX too.
_FP8_MOE_TOKENS = (1, 4096)


def moe_configs() -> list[CompiledConfig]:
    """The fused MoE's kernels as its default table launches them (bf16, no biases: the
    biases' loads come after the main loop) for each shape of `ember.bench.tune_moe` (its
    MXFP4 ones over packed experts), over FP8 experts too at `_FP8_MOE_TOKENS`: `fused_moe`
    itself run on CPU tensors under `ember.bench.offline_compile`, so each kernel is compiled
    from the launch the engine makes, alignment and sum over k included."""
    from ember.bench.offline_compile import compile_offline
    from ember.bench.tune_moe import MOE_SHAPES, empty_expert_weights, token_inputs
    from ember.kernels.fused_moe import fused_moe
    from ember.kernels.moe_tiles import MoeTuning, by_pair_moe_tiles

    results = []
    for name, shape in MOE_SHAPES.items():
        for tokens in _MOE_TOKENS:
            for form in _moe_forms(shape, tokens):
                weights = empty_expert_weights(shape, fp8=form == "fp8")
                inputs = {**weights, **token_inputs(shape, tokens, device="cpu")}
                tiles = MoeTuning().tiles_for(shape, tokens)
                if form == "ptx":  # MXFP4 decoded in PTX (`mxfp4_tile_k_major`)
                    if tiles.gemv:  # the heuristics' GEMV decodes on the CUDA cores
                        tiles = by_pair_moe_tiles(shape, tokens)
                    tiles = replace(
                        tiles,
                        gate_up=replace(tiles.gate_up, mxfp4_in_registers=True),
                        down=replace(tiles.down, mxfp4_in_registers=True),
                    )
                case = f"{name} T={tokens}" + _MOE_FORM_CASES[form]
                with compile_offline(90) as compiled:
                    fused_moe(**inputs, tiles=tiles)
                for kernel in compiled:
                    config = CompiledConfig(
                        kernel.name.strip("_"),
                        case,
                        kernel.constants,
                        kernel.num_warps,
                        kernel.shared_bytes,
                    )
                    results.append(config)
    return results


def _moe_forms(shape, tokens: int) -> tuple[str, ...]:
    """How ``shape``'s experts are compiled at ``tokens``: an MXFP4 shape through
    `tl.dot_scaled` ("packed"), and decoded in PTX too at `_FP8_MOE_TOKENS`; an FP8 shape in FP8
    at `_FP8_MOE_TOKENS` only; the others in bf16, and in FP8 too at `_FP8_MOE_TOKENS`."""
    if shape.fp8:
        return ("fp8",) if tokens in _FP8_MOE_TOKENS else ()
    extra = ("ptx" if shape.mxfp4 else "fp8",) if tokens in _FP8_MOE_TOKENS else ()
    return ("packed" if shape.mxfp4 else "bf16", *extra)


# Each form's case suffix.
_MOE_FORM_CASES = {"bf16": "", "packed": "", "fp8": ", fp8 experts", "ptx": ", ptx decode"}


def _without_cubin(row: dict) -> dict:
    return {key: value for key, value in row.items() if key != "cubin"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON list on stdout")
    args = parser.parse_args(argv)
    results = skinny_gemm_configs() + stream_k_gemm_configs() + attention_configs() + moe_configs()
    if args.json:
        print(json.dumps([{**_without_cubin(asdict(r)), "fits": r.fits} for r in results]))
    else:
        for r in results:
            verdict = "fits" if r.fits else "DOES NOT FIT"
            print(f"{r.kernel:22} {r.case:26} {r.shared_bytes / 1024:6.0f} KiB  {verdict}")
        print(f"limit {SM90_SHARED_MEMORY_LIMIT / 1024:.0f} KiB per block (sm_90)")
    return 0 if all(r.fits for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
