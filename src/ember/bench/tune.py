"""`ember bench tune`: the sweeps that the GPU tables of `ember.kernels.tuning` come from.

Re-run it on a new GPU or model shape and set the tables from what it reports. Each section
answers one table's question on the shapes of ``--preset``, and each row says what the tables
route there now beside what measured fastest:

- ``gemm``: each linear layer at decode batches (1-64 rows), cuBLAS against the skinny Triton GEMM
  on its default tiles and on a tile grid; gate/up in its gated form (cuBLAS then SiLU-and-mul
  against the fused kernel). `LinearRoutes`' skinny rules.
- ``attention``: decode attention over (batch, context) points, on a grid of decode tiles x KV
  splits, against the launches `AttentionPlanner` plans. `AttentionTuning`'s tiles and splits.
- ``split_k``: o and down past the skinny GEMM's rows, cuBLAS then the add + RMSNorm against P
  float32 partial sums that the norm adds up. `LinearRoutes.split_k_*`.
- ``stream_k``: gate/up past the skinny GEMM's rows, cuBLAS then SiLU-and-mul against the
  one-wave stream-K kernel. `LinearRoutes.stream_k_rows`.
- ``moe``: the fused MoE's paths and tiles per expert shape (``--moe-shapes``, not the preset)
  and token count, against the chosen experts' bytes (`ember.bench.tune_moe`). `MoeTuning`.

GEMMs are timed as a decode step runs them: layer after layer of distinct weights replayed from
one CUDA graph, so no weight stays in L2 (`ember.bench.roofline.sequence_seconds`). Attention is
timed alone, replayed from a graph with L2 flushed before each call (`gpu_seconds`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ember.bench.make_model import DENSE_PRESETS, PRESETS
from ember.bench.roofline import gpu_seconds, measure_ceilings, sequence_seconds
from ember.bench.tune_moe import MOE_SHAPES, MOE_TOKENS, bench_moe
from ember.kernels.tuning_files import merge_tune_into

SECTIONS = ("gemm", "attention", "split_k", "stream_k", "moe")

# -- rows ------------------------------------------------------------------------------------


def _us(measure, *args) -> float | str:
    """Microseconds of ``measure(*args)`` (seconds) or, where the kernel cannot launch, why."""
    try:
        return measure(*args) * 1e6
    except Exception as exc:  # noqa: BLE001 - a tile that does not fit is a result, not a crash
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def fastest(times: dict[str, float | str]) -> str | None:
    """The key of the shortest time; failures (strings) are left out."""
    timed = {key: us for key, us in times.items() if isinstance(us, float)}
    return min(timed, key=timed.get) if timed else None


def _print_row(row: dict, *detail: str) -> None:
    """One row on stdout as it lands, without its per-variant ``detail``."""
    print(json.dumps({key: value for key, value in row.items() if key not in detail}), flush=True)


# -- shapes ----------------------------------------------------------------------------------


def linear_shapes(preset: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of every distinct linear layer of a make-model preset."""
    cfg = PRESETS[preset]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    shape = AttentionShape.of(preset)
    q_size = shape.num_q_heads * shape.head_dim
    qkv = q_size + 2 * shape.num_kv_heads * shape.head_dim
    return [
        ("qkv", qkv, hidden),
        ("o", hidden, q_size),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
        ("lm_head", cfg["vocab_size"], hidden),
    ]


@dataclass(frozen=True)
class AttentionShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16

    @classmethod
    def of(cls, preset: str) -> AttentionShape:
        cfg = PRESETS[preset]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cls(heads, cfg["num_key_value_heads"], head_dim)


def decode_inputs(
    shape: AttentionShape,
    batch: int,
    context: int,
    dtype: torch.dtype,
    device: str = "cuda",
    cache_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """`paged_attention`'s step tensors for a decode step over a shuffled block pool (block 0
    left unused, as in the engine); the cache in ``cache_dtype`` (None: ``dtype``; float8 e4m3:
    an FP8 cache of unit scales)."""
    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = 1 + batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    ids = torch.randperm(num_blocks - 1, device=device, dtype=torch.int32) + 1

    def cache() -> torch.Tensor:
        return torch.randn(cache_shape, dtype=dtype, device=device).to(cache_dtype or dtype)

    return {
        "q": torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device),
        "k_cache": cache(),
        "v_cache": cache(),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "block_tables": ids.view(batch, blocks_per_seq),
    }


def decode_attention_bytes(
    shape: AttentionShape, batch: int, context: int, elem: int, cache_elem: int | None = None
) -> int:
    """Bytes a decode step's attention must move: K and V of every cached token (``cache_elem``
    bytes each; None: ``elem``), q in, out out, and the block tables."""
    kv = 2 * batch * context * shape.num_kv_heads * shape.head_dim * (cache_elem or elem)
    q_and_out = 2 * batch * shape.num_q_heads * shape.head_dim * elem
    tables = batch * -(-context // shape.block_size) * 4
    return kv + q_and_out + tables


# Layers of distinct weights in a sequence timing: an 8B model's 32, so one shape's weights dwarf
# L2 as in a step; the output projection (one a step, 1 GB in the 8B shape) takes fewer.
SEQUENCE_LAYERS = 32
_LAYERS = {"lm_head": 8}


def sequence_weights(n: int, k: int, layers: int, device: str = "cuda") -> list[torch.Tensor]:
    """``layers`` distinct random bf16 ``[n, k]`` weights, scaled to keep products near unit
    size."""
    return [torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5 for _ in range(layers)]


def fp8_sequence_weights(n: int, k: int, layers: int, device: str = "cuda") -> list:
    """`sequence_weights` quantized as `--quantization fp8` quantizes a model's at load: float8
    e4m3 with a scale per output row (`ember.layers.fp8.Fp8Weight`)."""
    from ember.layers.fp8 import fp8_weight_of

    return [fp8_weight_of(weight) for weight in sequence_weights(n, k, layers, device)]


def _router():
    """The linear routes of this GPU's `KernelTuning`, as the engine routes by them."""
    from ember.kernels.linear import LinearRouter
    from ember.kernels.tuning import KernelTuning

    return LinearRouter(KernelTuning.for_device(torch.device("cuda")).linear)


# -- gemm: the skinny GEMM against cuBLAS at decode batches ----------------------------------

GEMM_BATCHES = (1, 4, 8, 16, 32, 64)
# (BLOCK_N, BLOCK_K, STAGES, num_warps); BLOCK_M follows M.
GEMM_CONFIGS = (
    (16, 256, 4, 4),
    (32, 256, 4, 4),
    (64, 256, 4, 4),
    (16, 512, 4, 4),
    (32, 128, 6, 4),
    (32, 256, 6, 4),
    (32, 512, 3, 4),
    (64, 128, 4, 4),
    (32, 256, 4, 8),
    (64, 256, 3, 8),
    (128, 128, 4, 8),
    (256, 128, 3, 8),
)


def skinny_configs(
    m: int, configs=GEMM_CONFIGS, k_scale: int = 1, k: int | None = None
) -> dict[str, dict[str, int]]:
    """The skinny GEMM's swept tile configurations for ``m`` rows, by name; ``k_scale``: each
    BLOCK_K times this (2 for FP8 weights: a stage then moves a bf16 tile's weight bytes, as
    `default_config` sizes them), where it stays within ``k``."""
    from ember.kernels.skinny_gemm import block_m_for

    return {
        f"n{block_n}_k{block_k * k_scale}_s{stages}_w{warps}": {
            "BLOCK_M": block_m_for(m),
            "BLOCK_N": block_n,
            "BLOCK_K": block_k * k_scale,
            "STAGES": stages,
            "num_warps": warps,
        }
        for block_n, block_k, stages, warps in configs
        if k is None or block_k * k_scale <= k
    }


def cublas_layer(x, weights, product, silu_out, layer: int) -> None:
    """cuBLAS's product into ``product`` (an FP8 weight's as the engine runs it past the skinny
    kernel's rows, into a new tensor: the activations quantized per row, then cuBLASLt's FP8
    GEMM), and for a gated weight the SiLU-and-mul kernel after it, into ``silu_out``."""
    from ember.kernels.activation import silu_and_mul
    from ember.kernels.fp8_gemm import fp8_linear
    from ember.layers.fp8 import Fp8Weight

    weight = weights[layer]
    if isinstance(weight, Fp8Weight):
        product = fp8_linear(x, weight)
    else:
        torch.matmul(x, weight.t(), out=product)
    if silu_out is not None:
        silu_and_mul(product, out=silu_out)


def skinny_layer(x, weights, out, gated: bool, widen: bool, config, layer: int) -> None:
    """The skinny GEMM (its SiLU-and-mul form for a gated weight) on ``config`` (None: its
    default tiles); ``widen``: FP8 tiles widened in PTX."""
    from ember.kernels.skinny_gemm import skinny_gemm, skinny_gemm_silu

    gemm = skinny_gemm_silu if gated else skinny_gemm
    gemm(x, weights[layer], out=out, config=config, fp8_widen_in_registers=widen)


def bench_gemms(
    preset: str,
    hbm_bytes_per_s: float,
    batches=GEMM_BATCHES,
    configs=GEMM_CONFIGS,
    fp8_weights: bool = False,
) -> list[dict]:
    """Per linear layer and batch: µs per layer of cuBLAS, of the skinny GEMM on its default
    tiles and on each of ``configs``, the bytes' roofline, and whether the tables route the
    product (with plain launches; under PDL every decode-sized one) to the skinny kernel.
    ``fp8_weights``: the weights in FP8 (`fp8_sequence_weights`), the configs at twice their
    K, cuBLAS as cuBLASLt's FP8 GEMM, widened as the engine's routes say."""
    router = _router()
    widen = fp8_weights and router.routes.fp8_widen_in_registers
    rows = []
    for name, n, k in linear_shapes(preset):
        layers = _LAYERS.get(name, SEQUENCE_LAYERS)
        gated = name == "gate_up"
        weights = (fp8_sequence_weights if fp8_weights else sequence_weights)(n, k, layers)
        for m in batches:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n // 2 if gated else n, dtype=torch.bfloat16, device="cuda")
            product = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            cublas = partial(cublas_layer, x, weights, product, out if gated else None)
            skinny = partial(skinny_layer, x, weights, out, gated, widen)
            swept = skinny_configs(m, configs, 2 if fp8_weights else 1, k)
            by_config = {
                key: _us(sequence_seconds, partial(skinny, config), layers)
                for key, config in swept.items()
            }
            best = fastest(by_config)
            moved = (1 if fp8_weights else 2) * n * k + 2 * (m * k + m * n)
            if fp8_weights:
                routed = router.takes_fp8_skinny(m, x.dtype, x.device)
            else:
                takes = router.takes_gated_skinny if gated else router.takes_skinny
                routed = takes(m, n, k, x.dtype, x.device)
            row = {
                "weight_dtype": "fp8" if fp8_weights else "bf16",
                "shape": name,
                "n": n,
                "k": k,
                "m": m,
                "gated": gated,
                "bytes": moved,
                "roofline_us": moved / hbm_bytes_per_s * 1e6,
                "cublas_us": _us(sequence_seconds, cublas, layers),
                "skinny_us": _us(sequence_seconds, partial(skinny, None), layers),
                "best_config": best,
                "best_us": by_config.get(best),
                "routed_to_skinny": routed,
                "skinny_us_by_config": by_config,
            }
            rows.append(row)
            _print_row(row, "skinny_us_by_config")
        del weights
        torch.cuda.empty_cache()
    return rows


# -- attention: decode tiles x KV splits -----------------------------------------------------

ATTENTION_POINTS = (
    (1, 512),
    (8, 512),
    (32, 512),
    (64, 512),
    (128, 512),
    (256, 512),
    (1, 4096),
    (8, 4096),
    (32, 4096),
    (128, 4096),
)
# Decode tiles as `AttentionTuning` writes them: (BLOCK_N, num_warps, KV_STAGES).
ATTENTION_TILES = (
    (64, 2, 3),
    (64, 4, 2),
    (32, 1, 3),
    (64, 4, 3),
    (32, 4, 3),
    (32, 2, 4),
    (64, 4, 4),
    (128, 4, 2),
    (128, 8, 3),
    (16, 2, 4),
    (16, 1, 4),
    (64, 1, 3),
    (32, 1, 6),
)
ATTENTION_SPLITS = (1, 2, 4, 8, 16, 32)


def attention_planner(
    shape: AttentionShape,
    device: torch.device,
    elem_bytes: int = 2,
    query_elem_bytes: int | None = None,
):
    """The engine's planner for ``shape`` on ``device`` (its `AttentionTuning`); ``elem_bytes``:
    the KV cache's element size (1: FP8), ``query_elem_bytes`` the model's (None: the same)."""
    from ember.kernels.attention_plan import AttentionPlanner, AttentionTuning

    tuning = AttentionTuning.for_device(device)
    return AttentionPlanner(
        tuning,
        shape.num_q_heads,
        shape.num_kv_heads,
        shape.head_dim,
        elem_bytes,
        query_elem_bytes=query_elem_bytes,
    )


def launch_name(launches) -> str:
    """``n{BLOCK_N}_w{num_warps}_s{KV_STAGES}_x{splits}`` of a decode step's one launch."""
    (launch,) = launches
    tiles = launch.tiles
    return f"n{tiles['BLOCK_N']}_w{tiles['num_warps']}_s{tiles['KV_STAGES']}_x{launch.splits}"


def sweep_launches(
    planner, context: int, tiles=ATTENTION_TILES, splits=ATTENTION_SPLITS
) -> dict[str, tuple]:
    """A decode step's launch on each of ``tiles`` (BLOCK_N, num_warps, KV_STAGES) x each of
    ``splits`` that leaves every segment at least one tile of a ``context``-token sequence, by
    `launch_name`; the planner's rows per program (the GQA group, padded)."""
    from ember.kernels.attention_plan import AttentionLaunch

    block_m = planner.decode_tiles()["BLOCK_M"]
    sweep = {}
    for block_n, warps, stages in tiles:
        shape = {
            "BLOCK_M": block_m,
            "BLOCK_Q": 1,
            "BLOCK_N": block_n,
            "num_warps": warps,
            "KV_STAGES": stages,
        }
        for count in splits:
            if count * block_n <= context:
                launches = (AttentionLaunch(shape, decode_only=True, splits=count),)
                sweep[launch_name(launches)] = launches
    return sweep


def attend(
    inputs: dict[str, torch.Tensor],
    out: torch.Tensor,
    launches,
    counters,
    fp8_widen_in_registers: bool = False,
) -> None:
    """`paged_attention` of a `decode_inputs` step on ``launches``, into ``out`` (an FP8 cache's
    tiles widened in PTX where ``fp8_widen_in_registers``, as the engine's tuning says)."""
    from ember.kernels.paged_attention import paged_attention

    scale = inputs["q"].shape[-1] ** -0.5
    paged_attention(
        **inputs,
        scale=scale,
        out=out,
        launches=launches,
        split_counters=counters,
        fp8_widen_in_registers=fp8_widen_in_registers,
    )


def decode_attention_step(
    shape: AttentionShape, batch: int, context: int, planner=None, fp8_cache: bool = False
):
    """``run(launches)``: `attend` over one decode step's new inputs, into one output, with
    split counters kept across calls as the engine keeps them; ``fp8_cache``: an FP8 cache,
    widened as ``planner``'s tuning says."""
    cache_dtype = torch.float8_e4m3fn if fp8_cache else None
    inputs = decode_inputs(shape, batch, context, torch.bfloat16, cache_dtype=cache_dtype)
    counters = torch.zeros(batch * shape.num_kv_heads, dtype=torch.int32, device="cuda")
    widen = fp8_cache and planner is not None and planner.tuning.kv_fp8_widen_in_registers
    return partial(
        attend,
        inputs,
        torch.empty_like(inputs["q"]),
        counters=counters,
        fp8_widen_in_registers=widen,
    )


def bench_attention_tiles(
    preset: str,
    hbm_bytes_per_s: float,
    points=ATTENTION_POINTS,
    tiles=ATTENTION_TILES,
    splits=ATTENTION_SPLITS,
    fp8_cache: bool = False,
) -> list[dict]:
    """Per (batch, context): µs of every launch of `sweep_launches` (``tiles`` x ``splits``),
    the fastest against the bytes' roofline, and the planner's launch with its time; over a bf16
    cache, or an FP8 one (``fp8_cache``: bf16 queries, the engine's FP8 planner)."""
    shape = AttentionShape.of(preset)
    cache_elem = 1 if fp8_cache else 2
    planner = attention_planner(shape, torch.device("cuda"), cache_elem, query_elem_bytes=2)
    rows = []
    for batch, context in points:
        run = decode_attention_step(shape, batch, context, planner, fp8_cache)
        times = {
            key: _us(gpu_seconds, partial(run, launches))
            for key, launches in sweep_launches(planner, context, tiles, splits).items()
        }
        best = fastest(times)
        planned = planner.plan(batch, 1, context)
        moved = decode_attention_bytes(shape, batch, context, 2, cache_elem)
        row = {
            "kv_cache_dtype": "fp8" if fp8_cache else "bf16",
            "batch": batch,
            "context": context,
            "bytes": moved,
            "roofline_us": moved / hbm_bytes_per_s * 1e6,
            "best": best,
            "best_us": times.get(best),
            "best_fraction": moved / hbm_bytes_per_s / (times[best] * 1e-6) if best else None,
            "planned": launch_name(planned),
            "planned_us": _us(gpu_seconds, partial(run, planned)),
            "us": times,
        }
        rows.append(row)
        _print_row(row, "us")
        del run
        torch.cuda.empty_cache()
    return rows


# -- split_k: o and down as float32 partial sums the next norm adds --------------------------

SPLIT_K_ROWS = (96, 128, 192, 256)
SPLIT_K_PARTS = (2, 4)
SPLIT_K_SHAPES = ("o", "down")


def _cublas_then_norm(x, weights, residual, norm_weight, layer: int) -> None:
    from ember.kernels.rmsnorm import fused_add_rms_norm

    fused_add_rms_norm(torch.nn.functional.linear(x, weights[layer]), residual, norm_weight, 1e-5)


def _parts_then_norm(router, x, weights, residual, norm_weight, out, parts, layer: int) -> None:
    from ember.kernels.rmsnorm import add_parts_rms_norm

    partial_sums = router.linear_parts(x, weights[layer], parts=parts)
    add_parts_rms_norm(residual, partial_sums, norm_weight, 1e-5, out=out)


def bench_split_k(
    preset: str, rows=SPLIT_K_ROWS, parts_options=SPLIT_K_PARTS, shapes=SPLIT_K_SHAPES
) -> list[dict]:
    """Per (shape, rows): µs per layer of the product and the add + RMSNorm after it, with
    cuBLAS's product and with each split into float32 partial sums; how far each split's sum
    is from cuBLAS's product; and the parts the tables split it into now."""
    router = _router()
    dims = {name: (n, k) for name, n, k in linear_shapes(preset)}
    results = []
    for name in shapes:
        n, k = dims[name]
        weights = sequence_weights(n, k, SEQUENCE_LAYERS)
        norm_weight = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            residual = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
            normed = torch.empty_like(residual)
            cublas = partial(_cublas_then_norm, x, weights, residual, norm_weight)
            layer_us = {"cublas": _us(sequence_seconds, cublas, SEQUENCE_LAYERS)}
            mismatch = {}
            expected = torch.nn.functional.linear(x, weights[0]).float()
            for parts in parts_options:
                if k % parts:
                    continue
                key = f"parts_{parts}"
                summed = router.linear_parts(x, weights[0], parts=parts).sum(0)
                mismatch[key] = (summed.to(x.dtype).float() - expected).abs().max().item()
                split = partial(
                    _parts_then_norm, router, x, weights, residual, norm_weight, normed, parts
                )
                layer_us[key] = _us(sequence_seconds, split, SEQUENCE_LAYERS)
            best = fastest(layer_us)
            row = {
                "shape": name,
                "n": n,
                "k": k,
                "m": m,
                "layer_us": layer_us,
                "max_abs_diff_vs_cublas": mismatch,
                "best": best,
                "routed_parts": router.split_k_parts(m, n, k, x.dtype, x.device),
            }
            results.append(row)
            _print_row(row)
        del weights
        torch.cuda.empty_cache()
    return results


# -- stream_k: gate/up in one wave of whole tiles --------------------------------------------

STREAM_K_ROWS = (72, 96, 128, 160, 192, 256)
# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps); BLOCK_N counts gate and up rows.
STREAM_K_CONFIGS = (
    (128, 256, 64, 4, 8),
    (128, 128, 64, 6, 8),
    (64, 256, 64, 5, 4),
    (64, 128, 64, 8, 4),
)


def _stream_k_layer(x, weights, workspace, out, config, layer: int) -> None:
    from ember.kernels.stream_k_gemm import stream_k_gemm

    stream_k_gemm(x, weights[layer], workspace, gated=True, out=out, config=config)


def bench_stream_k(preset: str, rows=STREAM_K_ROWS, configs=STREAM_K_CONFIGS) -> list[dict]:
    """Per rows: µs per layer of gate/up and SiLU-and-mul, cuBLAS's product then the SiLU kernel
    against the gated stream-K kernel on its default tiles and on each of ``configs``; its
    largest error against cuBLAS's; and whether the tables route it to stream-K now."""
    from ember.kernels.activation import silu_and_mul
    from ember.kernels.stream_k_gemm import StreamKWorkspace, fits_one_wave

    router = _router()
    n, k = next((n, k) for name, n, k in linear_shapes(preset) if name == "gate_up")
    weights = sequence_weights(n, k, SEQUENCE_LAYERS)
    workspace = StreamKWorkspace()
    results = []
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(m, n // 2, dtype=torch.bfloat16, device="cuda")
        product = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        stream_k = partial(_stream_k_layer, x, weights, workspace, out)
        by_config = {}
        for block_m, block_n, block_k, stages, warps in configs:
            config = {
                "BLOCK_M": block_m,
                "BLOCK_N": block_n,
                "BLOCK_K": block_k,
                "STAGES": stages,
                "num_warps": warps,
            }
            key = f"m{block_m}_n{block_n}_k{block_k}_s{stages}_w{warps}"
            by_config[key] = _us(sequence_seconds, partial(stream_k, config), SEQUENCE_LAYERS)
        stream_k_us = _us(sequence_seconds, partial(stream_k, None), SEQUENCE_LAYERS)
        error = None
        if isinstance(stream_k_us, float):
            stream_k(None, 0)
            expected = silu_and_mul(torch.matmul(x, weights[0].t()))
            error = (out.float() - expected.float()).abs().max().item()
        best = fastest(by_config)
        row = {
            "shape": "gate_up",
            "n": n,
            "k": k,
            "m": m,
            "cublas_us": _us(
                sequence_seconds,
                partial(cublas_layer, x, weights, product, out),
                SEQUENCE_LAYERS,
            ),
            "stream_k_us": stream_k_us,
            "max_abs_diff_vs_cublas": error,
            "best_config": best,
            "best_us": by_config.get(best),
            "fits_one_wave": fits_one_wave(x, weights[0]),
            "routed_to_stream_k": router.takes_stream_k(x, weights[0]),
            "stream_k_us_by_config": by_config,
        }
        results.append(row)
        _print_row(row, "stream_k_us_by_config")
    del weights
    torch.cuda.empty_cache()
    return results


# -- the command ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(DENSE_PRESETS),
        default="llama-3.1-8b",
        help="the model shape whose layers are swept (dense: a mixture of experts' expert "
        "products are not these GEMMs)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="what to sweep (default: all), in this order",
    )
    parser.add_argument(
        "--weight-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="the gemm section's weights: auto the preset's dtype (bf16), fp8 float8 e4m3 with "
        "a scale per row, as `--quantization fp8` loads them",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="the attention section's cache: auto the preset's dtype (bf16), fp8 float8 e4m3 "
        "read by bf16 queries, as `ember serve --kv-cache-dtype fp8` runs it",
    )
    parser.add_argument(
        "--moe-shapes",
        nargs="+",
        choices=sorted(MOE_SHAPES),
        default=sorted(MOE_SHAPES),
        help="the expert shapes the moe section sweeps",
    )
    parser.add_argument(
        "--moe-tokens",
        nargs="+",
        type=int,
        default=list(MOE_TOKENS),
        help="the token counts the moe section sweeps",
    )
    parser.add_argument(
        "--merge-into",
        type=Path,
        metavar="FILE",
        help="also merge this run into FILE, a tune.json of earlier runs on this GPU (e.g. the "
        "shipped src/ember/kernels/tuned/<gpu>.json): its moe rows and table entries of the same "
        "shape and token count replaced, other sections replaced whole; created if absent",
    )


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("ember bench tune needs a CUDA GPU")
        return 2
    hbm = measure_ceilings().hbm_bytes_per_s
    result = {
        "gpu": torch.cuda.get_device_name(),
        "preset": args.preset,
        "hbm_copy_tb_per_s": hbm / 1e12,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tune.json"
    sweeps = {
        "gemm": lambda: bench_gemms(args.preset, hbm, fp8_weights=args.weight_dtype == "fp8"),
        "attention": lambda: bench_attention_tiles(
            args.preset, hbm, fp8_cache=args.kv_cache_dtype == "fp8"
        ),
        "split_k": lambda: bench_split_k(args.preset),
        "stream_k": lambda: bench_stream_k(args.preset),
        "moe": lambda: bench_moe(
            {name: MOE_SHAPES[name] for name in args.moe_shapes}, hbm, args.moe_tokens
        ),
    }
    for name in args.sections:
        result[name] = sweeps[name]()
        # Written after every section, so a later failure keeps what was measured.
        path.write_text(json.dumps(result, indent=1))
    if args.merge_into is not None:
        merge_tune_into(args.merge_into, result)
        print(f"merged into {args.merge_into}")
    return 0
