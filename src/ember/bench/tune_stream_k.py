"""`ember bench tune --stream-k`: the stream-K GEMM against cuBLAS at decode batches past 64.

Each (shape, rows) point is timed as a decode step runs its layers (`sequence_seconds`: 32
layers of distinct weights in one graph, so nothing stays in L2) for cuBLAS and for the stream-K
kernel on a grid of tiles, on one program per SM (stream-K) and on one program per tile (the
same kernel without the balancing, so its per-SM rate can be set against cuBLAS's). gate/up is
timed as the step needs it: cuBLAS then the SiLU-and-mul kernel, against the gated kernel. A
staircase of cuBLAS at 256 rows over N shows its wave quantisation.
"""

from __future__ import annotations

import json
from functools import partial

import torch

from ember.bench.kernel_bench import gpu_seconds, sequence_seconds
from ember.bench.tune import linear_shapes, sequence_weights

STREAM_K_ROWS = (128, 192, 256)
# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, num_warps)
STREAM_K_CONFIGS = (
    (128, 256, 64, 4, 8),
    (128, 128, 64, 6, 8),
    (64, 256, 64, 5, 4),
    (64, 128, 64, 8, 4),
)
# Layers of distinct weights per timing; the output projection's 1 GB weight takes fewer.
_LAYERS = {"lm_head": 8}
_DEFAULT_LAYERS = 32


def _config_key(config: tuple[int, ...]) -> str:
    return "x".join(str(v) for v in config)


def _as_dict(config: tuple[int, ...]) -> dict[str, int]:
    block_m, block_n, block_k, stages, warps = config
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "STAGES": stages,
            "num_warps": warps}  # fmt: skip


def _us(layer_fn, layers: int) -> float | str:
    try:
        return sequence_seconds(layer_fn, layers) * 1e6
    except Exception as exc:  # noqa: BLE001 - a tile that does not launch is a result
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def _cublas_layer(x, weights, product, silu_out, layer: int) -> None:
    from ember.kernels.activation import silu_and_mul

    torch.matmul(x, weights[layer].t(), out=product)
    if silu_out is not None:
        silu_and_mul(product, out=silu_out)


def _stream_k_layer(x, weights, workspace, gated, out, config, programs, layer: int) -> None:
    from ember.kernels.stream_k_gemm import stream_k_gemm

    stream_k_gemm(x, weights[layer], workspace, gated=gated, out=out, config=config,
                  num_programs=programs)  # fmt: skip


def bench_stream_k(preset: str, rows=STREAM_K_ROWS, configs=STREAM_K_CONFIGS) -> list[dict]:
    from ember.kernels.activation import silu_and_mul
    from ember.kernels.stream_k_gemm import StreamKWorkspace, num_tiles

    workspace = StreamKWorkspace()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for name, n, k in linear_shapes(preset):
        layers = _LAYERS.get(name, _DEFAULT_LAYERS)
        gated = name == "gate_up"
        weights = sequence_weights(n, k, layers)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n // 2 if gated else n, dtype=torch.bfloat16, device="cuda")
            product = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            cublas = partial(_cublas_layer, x, weights, product, out if gated else None)
            reference = torch.matmul(x, weights[0].t())
            if gated:
                reference = silu_and_mul(reference)
            row = {"shape": name, "n": n, "k": k, "m": m, "gated": gated, "layers": layers,
                   "flops": 2 * m * n * k, "cublas_us": _us(cublas, layers), "stream_k": {}}  # fmt: skip
            for config in configs:
                tiles = num_tiles(m, n, _as_dict(config))
                for label, programs in (("sk", sms), ("dp", tiles)):
                    ours = partial(_stream_k_layer, x, weights, workspace, gated, out,
                                   _as_dict(config), programs)  # fmt: skip
                    key = f"{label}_{_config_key(config)}"
                    entry = {"us": _us(ours, layers), "programs": programs, "tiles": tiles}
                    if isinstance(entry["us"], float):
                        ours(0)
                        torch.cuda.synchronize()
                        entry["max_err"] = (out.float() - reference.float()).abs().max().item()
                    row["stream_k"][key] = entry
            timed = {key: e["us"] for key, e in row["stream_k"].items()
                     if isinstance(e["us"], float)}  # fmt: skip
            if timed:
                row["best"] = min(timed, key=timed.get)
                row["best_us"] = timed[row["best"]]
            results.append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "stream_k"}), flush=True)
        del weights
        torch.cuda.empty_cache()
    return results


def cublas_staircase(m: int = 256, k: int = 4096, widths=range(2048, 32769, 1024)) -> list[dict]:
    """cuBLAS time at ``m`` rows over output widths: steps where a new wave of tiles starts."""
    rows = []
    for n in widths:
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        us = gpu_seconds(partial(torch.matmul, x, w.t(), out=out)) * 1e6
        rows.append({"m": m, "n": n, "k": k, "us": us, "tflops": 2 * m * n * k / us / 1e6})
    print(json.dumps(rows), flush=True)
    return rows


# gate/up's 28,672 columns cut in two cuBLAS products at widths the staircase ran fastest per
# column (the two write one [M, 28672] buffer).
GATE_UP_SPLITS = ((28672,), (18432, 10240), (22528, 6144), (14336, 14336), (16384, 12288))


def _cublas_split_layer(x, weights, product, widths, layer: int) -> None:
    start = 0
    for width in widths:
        torch.mm(
            x, weights[layer][start : start + width].t(), out=product[:, start : start + width]
        )
        start += width


def cublas_gate_up_splits(preset: str, rows=(128, 192, 256), splits=GATE_UP_SPLITS) -> list[dict]:
    """gate/up through cuBLAS in one product or two column ranges, timed in sequence."""
    dims = {name: (n, k) for name, n, k in linear_shapes(preset)}
    n, k = dims["gate_up"]
    weights = sequence_weights(n, k, _DEFAULT_LAYERS)
    results = []
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        product = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        expected = torch.matmul(x, weights[0].t())
        row = {"m": m, "n": n, "k": k, "us": {}}
        for widths in splits:
            if sum(widths) != n:
                continue
            layer = partial(_cublas_split_layer, x, weights, product, widths)
            key = "+".join(map(str, widths))
            row["us"][key] = _us(layer, _DEFAULT_LAYERS)
            layer(0)
            row.setdefault("equal", {})[key] = bool(torch.equal(product, expected))
        results.append(row)
        print(json.dumps(row), flush=True)
    del weights
    torch.cuda.empty_cache()
    return results
