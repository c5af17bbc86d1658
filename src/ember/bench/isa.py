"""`ember bench isa`: the fused MoE's kernels (``--sections linear``: the skinny GEMM over a
dense model's layers in bf16 and FP8; ``attention``: the paged attention's launches over a bf16
and an FP8 cache) compiled for an NVIDIA GPU without one, and what their K loops issue per
weight (or K/V) value.

For each expert shape of ``--moe-shapes`` and token count of ``--moe-tokens``, every path
`ember bench tune --sections moe` would time (``--candidates``: with each of its tile candidates
too) runs `fused_moe` on CPU tensors under `ember.bench.offline_compile`: the kernels a launch
on ``sm_<arch>`` would compile, and nothing run. Each compiled kernel is read back
(`ember.bench.sass`): its registers and spills, and each loop's instruction count and mix.
A weight product's loop also gets ``per_value``: instructions one thread issues an iteration
over the weight values it takes (``streams * BLOCK_N * BLOCK_K / threads``; two streams for
gate/up). Where a product is bound by decoding its weights (MXFP4 on Hopper), this is the figure
to lower; against the HBM bytes, an H100 SXM issues about 5 per MXFP4 value in the time it reads
one (33.4e12 lane instructions a second at 1.98 GHz over 6.3e9 values, 0.53 bytes each, at
3.35 TB/s), an H200 about 3.7.

Static counts, not times: a loop's latency, its memory stalls and how many programs fill the GPU
are `ember bench tune`'s to measure on the GPU itself.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from ember.bench.offline_compile import CompiledKernel, compile_offline
from ember.bench.sass import disassemble, loops, resources
from ember.bench.tune_moe import (
    MOE_SHAPES,
    candidates,
    empty_expert_weights,
    fit,
    narrow_weights,
    paths_for,
    token_inputs,
)
from ember.kernels.moe_tiles import MoeShape, MoeTiles

DEFAULT_TOKENS = (1, 4, 16, 256)
# Instructions of the SM's conversion units (16 results a clock per SM, against 64 for integer
# logic and 128 for fp32 arithmetic: `ember.kernels.fp8_widen`).
CONVERSIONS = frozenset({"F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP"})
# The tiles' heuristics size launches for this many SMs (H100 SXM and H200).
DEFAULT_NUM_SMS = 132


def tile_variants(tiles: MoeTiles, shape: MoeShape) -> list[MoeTiles]:
    """A path's heuristic tiles, then each product on each of the tune's candidates (the other
    product on the heuristics'), and for MXFP4 on the tensor cores both products decoding in
    registers."""
    variants = [tiles]
    for product in ("gate_up", "down"):
        for gemm in candidates(tiles, narrow_weights(shape)):
            variants.append(fit(replace(tiles, **{product: gemm}), shape))
    if shape.mxfp4 and not tiles.gemv:
        in_registers = {
            p: replace(getattr(tiles, p), mxfp4_in_registers=True) for p in ("gate_up", "down")
        }
        variants.append(replace(tiles, **in_registers))
    return list(dict.fromkeys(variants))


def kernel_report(kernel: CompiledKernel) -> dict:
    """A compiled kernel's constexprs, registers and loops (``per_value`` for a weight
    product's; the instruction mix of the longest)."""
    used = resources(kernel.cubin)
    constants = kernel.constants
    weight_form = "W_FORMAT" in constants or "W_SCALED" in constants
    weight_product = "BLOCK_N" in constants and "BLOCK_K" in constants and weight_form
    # Gate/up reads two weight rows a column.
    streams = 2 if "ACTIVATION" in constants or constants.get("GATED") else 1
    values = None
    if weight_product:
        values = streams * constants["BLOCK_N"] * constants["BLOCK_K"] / (kernel.num_warps * 32)
    found = loops(disassemble(kernel.cubin))
    hottest = max(found, key=lambda loop: len(loop.body), default=None)
    loop_rows = []
    for loop in found:
        conversions = sum(i.mnemonic in CONVERSIONS for i in loop.body)
        row = {"instructions": len(loop.body), "conversions": conversions}
        if loop is hottest:  # the mix of the loop that takes the time, not of every loop
            row["mix"] = loop.mix(8)
        if values:
            row["values_per_thread"] = values
            row["per_value"] = round(len(loop.body) / values, 2)
            row["conversions_per_value"] = round(conversions / values, 2)
        loop_rows.append(row)
    return {
        "kernel": kernel.name,
        "constants": {k: v for k, v in constants.items() if isinstance(v, int | str | float)},
        "num_warps": kernel.num_warps,
        "num_stages": kernel.num_stages,
        "registers": used.registers,
        "spill_bytes": used.local_bytes,
        "loops": loop_rows,
    }


def compile_path(inputs: dict, tiles: MoeTiles, arch: int) -> list[dict]:
    """The kernels `fused_moe` compiles for ``tiles`` on ``sm_<arch>``, reported."""
    from ember.kernels.fused_moe import fused_moe

    with compile_offline(arch) as compiled:
        fused_moe(**inputs, tiles=tiles)
    return [kernel_report(kernel) for kernel in compiled]


def hottest_per_value(kernels: list[dict]) -> dict[str, float]:
    """Each weight product's largest loop's ``per_value``, by kernel name."""
    best = {}
    for kernel in kernels:
        timed = [loop for loop in kernel["loops"] if "per_value" in loop]
        if timed:
            best[kernel["kernel"]] = max(timed, key=lambda loop: loop["instructions"])["per_value"]
    return best


def bench_isa(
    shapes: dict[str, MoeShape],
    tokens: tuple[int, ...],
    arch: int,
    num_sms: int,
    with_candidates: bool,
    paths: tuple[str, ...] | None = None,
) -> list[dict]:
    """The rows of every (shape, tokens, path, tiles): ``paths`` (None: all) by the tune's
    names (``by_pair``, ``by_pair_split``, ``by_pair_gemv``, ``grouped_m<rows>``)."""
    rows = []
    for name, shape in shapes.items():
        weights = empty_expert_weights(shape)
        for count in tokens:
            inputs = {**weights, **token_inputs(shape, count, device="cpu")}
            for path, tiles in paths_for(shape, count, num_sms).items():
                if paths is not None and path not in paths:
                    continue
                variants = tile_variants(tiles, shape) if with_candidates else [tiles]
                for variant in variants:
                    kernels = compile_path(inputs, variant, arch)
                    row = {
                        "shape": name,
                        "tokens": count,
                        "path": path,
                        "heuristic": variant is tiles,
                        "tiles": variant.as_dict(),
                        "per_value": hottest_per_value(kernels),
                        "kernels": kernels,
                    }
                    print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
                    rows.append(row)
    return rows


def bench_linear_isa(preset: str, rows: tuple[int, ...], arch: int) -> list[dict]:
    """The skinny GEMM over each linear layer of ``preset`` (the fused gate/up as the engine
    runs it, with its SiLU) at each count of ``rows``: bf16 weights, FP8 weights widened by
    Triton's conversions, and FP8 widened in registers (`ember.kernels.fp8_widen`)."""
    from ember.bench.tune import linear_shapes
    from ember.kernels.skinny_gemm import skinny_gemm, skinny_gemm_silu
    from ember.layers.fp8 import FP8_DTYPE, Fp8Weight

    forms = {"bf16": (False, False), "fp8": (True, False), "fp8_in_registers": (True, True)}
    result = []
    for name, n, k in linear_shapes(preset):
        gemm = skinny_gemm_silu if name == "gate_up" else skinny_gemm
        for count in rows:
            x = torch.empty(count, k, dtype=torch.bfloat16)
            for form, (fp8, in_registers) in forms.items():
                weight = torch.empty(n, k, dtype=torch.bfloat16)
                if fp8:
                    weight = Fp8Weight(weight.to(FP8_DTYPE), torch.empty(n))
                with compile_offline(arch) as compiled:
                    gemm(x, weight, fp8_widen_in_registers=in_registers)
                kernels = [kernel_report(kernel) for kernel in compiled]
                row = {"layer": name, "n": n, "k": k, "rows": count, "weights": form}
                row["per_value"] = hottest_per_value(kernels)
                print(json.dumps(row), flush=True)
                result.append({**row, "kernels": kernels})
    return result


def bench_attention_isa() -> list[dict]:
    """The paged attention's launches as `ember.bench.compile_check` compiles them (the 8B
    shape on an H200's plan; bf16 cache, FP8 cache widened by Triton's conversions and in PTX):
    each launch's KV loop, per K/V value a thread takes an iteration (``2 * BLOCK_N *
    HEAD_DIM / threads``)."""
    from ember.bench.compile_check import attention_configs

    result = []
    with tempfile.TemporaryDirectory() as folder:
        for config in attention_configs():
            cubin = Path(folder) / "kernel.cubin"
            cubin.write_bytes(config.cubin)
            hot = max(loops(disassemble(cubin)), key=lambda loop: len(loop.body))
            constants = config.constexprs
            values = 2 * constants["BLOCK_N"] * constants["HEAD_DIM"] / (config.num_warps * 32)
            conversions = sum(i.mnemonic in CONVERSIONS for i in hot.body)
            row = {
                "case": config.case,
                "kv_fp8": constants["KV_FP8"],
                "instructions": len(hot.body),
                "kv_values_per_thread": values,
                "per_kv_value": round(len(hot.body) / values, 2),
                "conversions_per_kv_value": round(conversions / values, 2),
            }
            print(json.dumps(row), flush=True)
            result.append({**row, "mix": hot.mix(12)})
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=("moe", "linear", "attention"),
        default=["moe"],
        help="moe: the fused MoE's paths; linear: the skinny GEMM over --preset's layers in "
        "bf16 and FP8; attention: the paged attention's launches over a bf16 and an FP8 cache",
    )
    parser.add_argument("--preset", default="llama-3.1-8b", help="linear: the layers' shapes")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16], help="linear: rows")
    parser.add_argument(
        "--moe-shapes", nargs="+", choices=sorted(MOE_SHAPES), default=["gpt-oss-20b-mxfp4"]
    )
    parser.add_argument("--moe-tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS))
    parser.add_argument("--num-sms", type=int, default=DEFAULT_NUM_SMS)
    parser.add_argument(
        "--paths", nargs="+", default=None, help="by_pair, by_pair_split, by_pair_gemv, grouped_m16"
    )
    parser.add_argument(
        "--candidates", action="store_true", help="every tile candidate of the tune, too"
    )
    parser.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> int:
    report: dict = {"arch": args.arch, "num_sms": args.num_sms}
    if "moe" in args.sections:
        shapes = {name: MOE_SHAPES[name] for name in args.moe_shapes}
        paths = tuple(args.paths) if args.paths else None
        report["rows"] = bench_isa(
            shapes, tuple(args.moe_tokens), args.arch, args.num_sms, args.candidates, paths
        )
    if "linear" in args.sections:
        report["linear"] = bench_linear_isa(args.preset, tuple(args.rows), args.arch)
    if "attention" in args.sections:  # compile_check's launches: sm_90
        report["attention"] = bench_attention_isa()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f)  # compact: thousands of loops
    return 0
