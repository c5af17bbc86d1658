"""`ember bench tune --sections moe`: the fused MoE's paths and tiles per expert shape and token
count, the rows of `ember.kernels.moe_tiles.MoeTuning`.

For each shape of ``--moe-shapes`` and token count of ``--moe-tokens`` (uniformly random
routing), every path that can serve the count (by pair up to `BY_PAIR_MAX_TOKENS`; grouped on
each block size that fits the rows per expert) is timed whole, `fused_moe` replayed from a CUDA
graph with L2 flushed before each call (`ember.bench.roofline.gpu_seconds`: a decode step's
layers never find their experts in L2). A coordinate sweep per path: gate/up's tile candidates
with down's tiles held at the heuristics', then down's with gate/up's best. Each row reports
the floor (the chosen experts' weight bytes, and x and out, over the measured HBM copy rate),
the heuristics' time, the best and its tiles; at grouped sizes also the two products alone
against torch's grouped GEMM (``torch._grouped_mm``) on the same blocks, which says whether a
library path would pay at large prefills. The section's ``table`` holds the best tiles as
`MeasuredMoeTiles` rows, which `ember serve --kernel-tuning FILE` reads
(`ember.kernels.tuning_files`).

The ``-mxfp4`` shapes are gpt-oss's experts as its checkpoints hold them, packed in MXFP4
(`ember.layers.mxfp4`): the same sweep over the kernels' MXFP4 variant, its floor counting the
packed bytes (and their scales), its rows of the table their own (`MoeShape.mxfp4`). The
``-fp8`` shapes are experts in float8 e4m3 with a scale a row (`--quantization fp8`, FP8
checkpoints), swept likewise on one byte an element (`MoeShape.fp8`): until a tune measures
them, FP8 experts run on the heuristics' tiles of their activations' dtype.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from ember.kernels.moe_tiles import (
    GemmTiles,
    MeasuredMoeTiles,
    MoeShape,
    MoeTiles,
    MoeTuning,
    by_pair_moe_tiles,
    default_moe_tiles,
    fit_shared_memory,
)
from ember.kernels.tuning_files import measured_as_dict
from ember.layers.fp8 import FP8_DTYPE, Fp8Weight, dense_weight, fp8_weight_of
from ember.layers.mxfp4 import BLOCK_BYTES, Mxfp4Weight
from ember.weights.mxfp4 import BLOCK_COLUMNS, quantize_mxfp4

# Expert shapes of the MoE models ember serves: (E, H, I, k), bf16 activations; the -mxfp4
# ones with their weights packed, as gpt-oss's checkpoints hold them.
MOE_SHAPES = {
    "gpt-oss-20b": MoeShape(num_experts=32, hidden=2880, intermediate=2880, top_k=4),
    "qwen3-30b-a3b": MoeShape(num_experts=128, hidden=2048, intermediate=768, top_k=8),
    "gpt-oss-20b-mxfp4": MoeShape(32, 2880, 2880, 4, mxfp4=True),
    "gpt-oss-120b-mxfp4": MoeShape(128, 2880, 2880, 4, mxfp4=True),
    # FP8 experts (`--quantization fp8`, FP8 checkpoints): bf16 activations, e4m3 weights.
    "qwen3-30b-a3b-fp8": MoeShape(128, 2048, 768, 8, fp8=True),
    "llama-4-scout-fp8": MoeShape(16, 5120, 8192, 1, fp8=True),
}
MOE_TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
BY_PAIR_MAX_TOKENS = 16
BLOCK_MS = (16, 32, 64, 128)
# Weight-stream candidates (decode): (block_n, block_k, stages, num_warps).
STREAM_CANDIDATES = (
    (16, 128, 4, 4),
    (16, 256, 4, 4),
    (32, 128, 4, 4),
    (32, 256, 3, 4),
    (64, 128, 4, 4),
    (64, 256, 3, 8),
)
# MXFP4 and FP8 weights move a quarter and a half of bf16's bytes a K step: longer steps too.
LONG_K_STREAM_CANDIDATES = ((16, 512, 4, 4), (32, 512, 3, 8))
# GEMV candidates (by pair on the CUDA cores): (block_n, block_k, stages, num_warps).
GEMV_CANDIDATES = (
    (4, 256, 2, 4),
    (8, 256, 2, 4),
    (16, 256, 2, 4),
    (8, 512, 2, 4),
    (16, 128, 2, 4),
    (32, 256, 2, 8),
    (8, 256, 1, 2),
)
# Tensor-core candidates (prefill): (block_n, block_k, stages, num_warps, group_m).
GEMM_CANDIDATES = (
    (64, 64, 4, 4, 8),
    (64, 64, 3, 8, 8),
    (128, 64, 3, 8, 8),
    (128, 64, 4, 8, 1),
    (64, 128, 3, 8, 8),
)


def block_ms_for(shape: MoeShape, tokens: int) -> list[int]:
    """Block sizes worth timing: up to the first whose rows cover the mean rows per expert."""
    rows = tokens * shape.top_k / shape.num_experts
    sizes = []
    for block_m in BLOCK_MS:
        sizes.append(block_m)
        if block_m >= rows:
            break
    return sizes


def paths_for(shape: MoeShape, tokens: int, num_sms: int) -> dict[str, MoeTiles]:
    """The heuristic tiles of each path that can serve ``tokens``, by name."""
    paths = {}
    if tokens <= BY_PAIR_MAX_TOKENS:
        by_pair = by_pair_moe_tiles(shape, tokens, MoeTuning(num_sms))
        paths["by_pair"] = replace(by_pair, down_by_token=True)
        paths["by_pair_split"] = replace(by_pair, down_by_token=False)
        paths["by_pair_gemv"] = by_pair_moe_tiles(shape, tokens, MoeTuning(num_sms), gemv=True)
    grouped_only = MoeTuning(num_sms=num_sms, by_pair_max_tokens=0)
    grouped = default_moe_tiles(shape, tokens, grouped_only)
    for block_m in block_ms_for(shape, tokens):
        tiles = grouped if grouped.block_m == block_m else _grouped_tiles(grouped, block_m)
        paths[f"grouped_m{block_m}"] = fit(tiles, shape)
    return paths


def fit(tiles: MoeTiles, shape: MoeShape) -> MoeTiles:
    """``tiles`` fitted to an SM's shared memory for ``shape``'s activations and weights."""
    return fit_shared_memory(tiles, shape.elem_bytes, weight_bytes=shape.weight_bytes)


def _grouped_tiles(tiles: MoeTiles, block_m: int) -> MoeTiles:
    """The heuristics' tiles for another block size: tensor-core tiles past 16 rows."""
    if block_m == 16 or tiles.block_m > 16:
        return replace(tiles, block_m=block_m)
    warps = 4 if block_m <= 32 else 8
    return MoeTiles(False, block_m, GemmTiles(64, 64, 4, warps, 8), GemmTiles(64, 64, 4, warps, 8))


def candidates(tiles: MoeTiles, narrow_weights: bool = False) -> list[GemmTiles]:
    """The product tiles swept for a path: GEMV ones for the CUDA-core path, weight-stream
    ones at 16 rows (longer K steps too for ``narrow_weights``, MXFP4's or FP8's: fewer bytes
    an element than the activations), tensor-core above."""
    if tiles.gemv:
        return [GemmTiles(*c) for c in GEMV_CANDIDATES]
    if tiles.block_m <= 16:
        extra = LONG_K_STREAM_CANDIDATES if narrow_weights else ()
        return [GemmTiles(*c) for c in (*STREAM_CANDIDATES, *extra)]
    return [GemmTiles(*c) for c in GEMM_CANDIDATES]


def selected_bytes(shape: MoeShape, topk_ids: torch.Tensor) -> int:
    """Bytes a step must move: each chosen expert's w13 and w2 once (packed, with their scales,
    for MXFP4), x in and out out."""
    experts = int(torch.unique(topk_ids).numel())
    weights = experts * 3 * shape.hidden * shape.intermediate * shape.weight_bytes
    return int(weights) + 2 * topk_ids.shape[0] * shape.hidden * shape.elem_bytes


def expert_weights(shape: MoeShape, seed: int = 0, device: str = "cuda") -> dict:
    """Random bf16 ``w13`` and ``w2`` of ``shape``, scaled to keep products near unit size;
    for an ``mxfp4`` shape, quantized (an expert at a time) into `Mxfp4Weight`s, for an ``fp8``
    one into `Fp8Weight`s (a scale a row, as `--quantization fp8` quantizes experts)."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate

    def draw(rows: int, cols: int) -> torch.Tensor | Mxfp4Weight | Fp8Weight:
        if not (shape.mxfp4 or shape.fp8):
            drawn = torch.randn(e, rows, cols, generator=g, device=device) / cols**0.5
            return drawn.to(torch.bfloat16)
        quantize = quantize_mxfp4 if shape.mxfp4 else fp8_weight_of
        experts = [
            quantize(torch.randn(rows, cols, generator=g, device=device) / cols**0.5)
            for _ in range(e)
        ]
        stacked = (torch.stack(parts) for parts in zip(*experts, strict=True))
        return Mxfp4Weight(*stacked) if shape.mxfp4 else Fp8Weight(*stacked)

    return {"w13": draw(2 * i, h), "w2": draw(h, i)}


def empty_expert_weights(shape: MoeShape, fp8: bool = False) -> dict:
    """Unfilled ``w13`` and ``w2`` of ``shape`` on the CPU, for compiling the kernels that take
    them (a compile reads only their dtypes and strides): bf16, packed MXFP4 for an ``mxfp4``
    shape, or FP8 experts for an ``fp8`` shape or with ``fp8`` (`Fp8Weight`, float32 row
    scales)."""
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    fp8 = fp8 or shape.fp8

    def weight(rows: int, cols: int) -> torch.Tensor | Mxfp4Weight | Fp8Weight:
        if shape.mxfp4:
            groups = cols // BLOCK_COLUMNS
            blocks = torch.empty(e, rows, groups, BLOCK_BYTES, dtype=torch.uint8)
            return Mxfp4Weight(blocks, torch.empty(e, rows, groups, dtype=torch.uint8))
        if fp8:
            scale = torch.empty(e, rows, dtype=torch.float32)
            return Fp8Weight(torch.empty(e, rows, cols, dtype=FP8_DTYPE), scale)
        return torch.empty(e, rows, cols, dtype=torch.bfloat16)

    return {"w13": weight(2 * i, h), "w2": weight(h, i)}


def token_inputs(shape: MoeShape, tokens: int, seed: int = 0, device: str = "cuda") -> dict:
    """``x`` in bf16 and a routing uniformly random over distinct experts."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, shape.num_experts, generator=g, device=device)
    weights, ids = scores.topk(shape.top_k, dim=1)
    x = torch.randn(tokens, shape.hidden, generator=g, device=device).to(torch.bfloat16)
    return {
        "x": x,
        "topk_weights": weights / weights.sum(1, keepdim=True),
        "topk_ids": ids.to(torch.int32),
    }


def _run_moe(inputs: dict, tiles: MoeTiles, tuning: MoeTuning) -> None:
    from ember.kernels.fused_moe import fused_moe

    fused_moe(**inputs, tiles=tiles, tuning=tuning)


def sweep_path(measure, tiles: MoeTiles, shape: MoeShape) -> tuple[MoeTiles, dict[str, object]]:
    """Coordinate sweep of one path from ``tiles``: gate/up's candidates, then down's with
    gate/up's best, fitted to ``shape``'s shared memory, then (MXFP4 on the tensor cores) each
    product's best decoding in registers rather than through `tl.dot_scaled`; ``measure(tiles)``
    gives µs (or why it failed). Returns the best tiles and every timing by `tiles_key`."""
    from ember.bench.tune import fastest

    times: dict[str, object] = {}

    def timed(trial: MoeTiles) -> object:
        key = tiles_key(trial)
        if key not in times:
            times[key] = measure(trial)
        return times[key]

    def keep_fastest(trials: list[MoeTiles]) -> MoeTiles:
        by_key = {tiles_key(best): best, **{tiles_key(t): t for t in trials}}
        winner = fastest({key: timed(trial) for key, trial in by_key.items()})
        return best if winner is None else by_key[winner]

    best = tiles
    timed(best)
    for product in ("gate_up", "down"):
        gemms = candidates(tiles, narrow_weights(shape))
        best = keep_fastest([fit(replace(best, **{product: gemm}), shape) for gemm in gemms])
    if shape.mxfp4 and not best.gemv:  # each product's tiles decoding in registers instead
        for product in ("gate_up", "down"):
            gemm = replace(getattr(best, product), mxfp4_in_registers=True)
            best = keep_fastest([replace(best, **{product: gemm})])
    return best, times


def narrow_weights(shape: MoeShape) -> bool:
    """Whether ``shape``'s weights take fewer bytes an element than its activations."""
    return shape.weight_bytes < shape.elem_bytes


def tiles_key(tiles: MoeTiles) -> str:
    path = "gemv" if tiles.gemv else f"m{tiles.block_m}"
    return f"{path}_gu_{tiles.gate_up.name()}_dn_{tiles.down.name()}"


def _products_us(inputs: dict, tiles: MoeTiles, tuning: MoeTuning) -> dict[str, object]:
    """µs of the grouped path's two products alone, Triton's and torch's grouped GEMM's, on
    the same aligned blocks (the alignment, gathers and sum left out of both). MXFP4 experts:
    torch's grouped GEMM on their dequantized bf16 weights (what dequantizing at load would
    run); FP8 experts: on theirs too."""
    from ember.bench.roofline import gpu_seconds
    from ember.bench.tune import _us
    from ember.kernels.moe_align import align_pairs
    from ember.kernels.moe_gemm import down_grouped, gate_up_grouped

    x, w13, w2 = inputs["x"], inputs["w13"], inputs["w2"]

    def dense(weight) -> torch.Tensor:
        if isinstance(weight, Mxfp4Weight):
            return weight.dequantize(x.dtype)
        return dense_weight(weight, x.dtype)

    w13_dense, w2_dense = dense(w13), dense(w2)
    w13_scale = w2_scale = None
    if isinstance(w13, Mxfp4Weight | Fp8Weight):
        (w13, w13_scale), (w2, w2_scale) = w13, w2
    ids = inputs["topk_ids"].reshape(-1).contiguous()
    weights = inputs["topk_weights"].reshape(-1).contiguous()
    k = inputs["topk_ids"].shape[1]
    blocks = align_pairs(ids, w13.shape[0], tiles.block_m, tuning.align_kernel_max_pairs)
    parts = torch.empty(ids.numel(), x.shape[1], dtype=x.dtype, device=x.device)

    in_ptx = {"fp8_in_registers": tuning.fp8_widen_in_registers}

    def triton_products() -> None:
        inter = gate_up_grouped(x, w13, None, blocks, k, "silu", tiles.gate_up, w13_scale, **in_ptx)
        down_grouped(inter, w2, None, weights, blocks, tiles.down, parts, w2_scale, **in_ptx)

    # torch's grouped GEMM on the same rows: x gathered into sorted order, each expert's run
    # ending at its padded end.
    pairs = ids.numel()
    rows = blocks.sorted_ids.long()
    x_sorted = x[torch.where(rows < pairs, rows // k, 0)]
    counts = torch.bincount(ids.long(), minlength=w13.shape[0])
    ends = ((counts + tiles.block_m - 1) // tiles.block_m * tiles.block_m).cumsum(0).int()
    # The activation is left out of this side: a lower bound for a library path.
    hidden_rows = torch.randn(rows.numel(), w2_dense.shape[2], device=x.device).to(x.dtype)

    def library_products() -> None:
        torch._grouped_mm(x_sorted, w13_dense.transpose(1, 2), offs=ends)
        torch._grouped_mm(hidden_rows, w2_dense.transpose(1, 2), offs=ends)

    return {
        "triton_products_us": _us(gpu_seconds, triton_products),
        "grouped_mm_products_us": _us(gpu_seconds, library_products),
    }


def bench_moe_point(
    name: str, shape: MoeShape, weights: dict, tokens: int, hbm_bytes_per_s: float, tuning
) -> tuple[dict, MoeTiles | None]:
    """One (shape, tokens) row: µs of each path on its heuristic tiles and on its sweep's
    best, against the selected-bytes floor; and the best tiles of all."""
    from ember.bench.roofline import gpu_seconds
    from ember.bench.tune import _us, fastest

    inputs = {**weights, **token_inputs(shape, tokens)}
    floor_us = selected_bytes(shape, inputs["topk_ids"]) / hbm_bytes_per_s * 1e6

    def measure(tiles: MoeTiles) -> object:
        return _us(gpu_seconds, partial(_run_moe, inputs, tiles, tuning))

    best_by_path, us_by_path = {}, {}
    for path, tiles in paths_for(shape, tokens, tuning.num_sms).items():
        best, times = sweep_path(measure, tiles, shape)
        best_by_path[path] = best
        us_by_path[path] = {"default": times[tiles_key(tiles)], **times}
    winner = fastest({p: us_by_path[p][tiles_key(b)] for p, b in best_by_path.items()})
    best = best_by_path.get(winner)
    table_tiles = tuning.tiles_for(shape, tokens)
    row = {
        "shape": name,
        **shape._asdict(),
        "tokens": tokens,
        "floor_us": floor_us,
        "table_tiles": table_tiles.as_dict(),
        "table_us": measure(table_tiles),
        "best_path": winner,
        "best_tiles": best.as_dict() if best else None,
        "best_us": us_by_path[winner][tiles_key(best)] if best else None,
        "us_by_path": us_by_path,
    }
    if best is not None:
        row["best_over_floor"] = row["best_us"] / floor_us
        if not best.by_pair:
            row.update(_products_us(inputs, best, tuning))
    return row, best


def bench_moe(
    shapes: dict[str, MoeShape], hbm_bytes_per_s: float, tokens=MOE_TOKENS
) -> dict[str, object]:
    """`bench_moe_point` over ``shapes`` x ``tokens``; ``table``: each point's best tiles as
    `MeasuredMoeTiles` rows (`ember.kernels.tuning_files` reads them back)."""
    from ember.bench.tune import _print_row
    from ember.kernels.tuning import KernelTuning

    tuning = KernelTuning.for_device(torch.device("cuda")).moe
    rows, table = [], []
    for name, shape in shapes.items():
        weights = expert_weights(shape)
        for count in tokens:
            row, best = bench_moe_point(name, shape, weights, count, hbm_bytes_per_s, tuning)
            rows.append(row)
            _print_row(row, "us_by_path")
            if best is not None:
                table.append(measured_as_dict(MeasuredMoeTiles(shape, count, best)))
        del weights
        torch.cuda.empty_cache()
    return {"rows": rows, "table": table}
