"""`ember bench tune --split-k`: o and down as split-K partial sums reduced in the next norm.

Past the skinny GEMM's rows the plain residual form runs each sub-block's exit as cuBLAS then
the fused add + RMSNorm kernel; for o and down (output no wider than the input) cuBLAS itself
runs split-K plus a reduce kernel at 256 rows (bench/results/README.md, "Final run of the
sixteenth session"). This times, per layer, as a step runs them (`sequence_seconds`: 32
layers of distinct weights in one graph), the product and the norm that follows it:

- ``cublas``: ``F.linear`` then `fused_add_rms_norm` (the engine's form);
- ``parts_P``: one batched cuBLAS GEMM of P float32 partial sums (`linear_parts`) then
  `add_parts_rms_norm`, which sums them;
- ``norm_only``: the fused add + RMSNorm alone, for each product's share.
"""

from __future__ import annotations

import json
from functools import partial

import torch

from ember.bench.tune import linear_shapes, sequence_us, sequence_weights

SPLIT_K_ROWS = (96, 128, 192, 256)
SPLIT_K_PARTS = (2, 4)
SPLIT_K_SHAPES = ("o", "down")


def _cublas_then_norm(x, weights, residual, norm_weight, layer: int) -> None:
    from ember.kernels.rmsnorm import fused_add_rms_norm

    product = torch.nn.functional.linear(x, weights[layer])
    fused_add_rms_norm(product, residual, norm_weight, 1e-5)


def _norm_only(product, residual, norm_weight, layer: int) -> None:
    from ember.kernels.rmsnorm import fused_add_rms_norm

    fused_add_rms_norm(product, residual, norm_weight, 1e-5)


def _parts_then_norm(x, weights, residual, norm_weight, normed, parts, layer: int) -> None:
    from ember.kernels.linear import linear_parts
    from ember.kernels.rmsnorm import add_parts_rms_norm

    partial_sums = linear_parts(x, weights[layer], parts=parts)
    add_parts_rms_norm(residual, partial_sums, norm_weight, 1e-5, out=normed)


def bench_split_k(
    preset: str, rows=SPLIT_K_ROWS, parts_options=SPLIT_K_PARTS, shapes=SPLIT_K_SHAPES
) -> list[dict]:
    """One row per (shape, rows): µs per layer of each variant, how far each split's summed
    halves are from cuBLAS's product, and the best split with what it saves over cuBLAS."""
    from ember.kernels.linear import linear_parts

    dims = {name: (n, k) for name, n, k in linear_shapes(preset)}
    results = []
    for name in shapes:
        n, k = dims[name]
        weights = sequence_weights(n, k)
        norm_weight = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            residual = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
            normed = torch.empty_like(residual)
            product = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
            layer_us = {
                "norm_only": sequence_us(partial(_norm_only, product, residual, norm_weight)),
                "cublas": sequence_us(
                    partial(_cublas_then_norm, x, weights, residual, norm_weight)
                ),
            }
            mismatch = {}
            for parts in parts_options:
                if k % parts:
                    continue
                summed = linear_parts(x, weights[0], parts=parts).sum(0).to(x.dtype)
                expected = torch.nn.functional.linear(x, weights[0])
                mismatch[f"parts_{parts}"] = (summed.float() - expected.float()).abs().max().item()
                layer_us[f"parts_{parts}"] = sequence_us(
                    partial(_parts_then_norm, x, weights, residual, norm_weight, normed, parts)
                )
            timed = {key: us for key, us in layer_us.items() if isinstance(us, float)}
            splits = {key: us for key, us in timed.items() if key.startswith("parts_")}
            best = min(splits, key=splits.get) if splits else None
            row = {"shape": name, "n": n, "k": k, "m": m, "layer_us": layer_us,
                   "max_abs_diff_vs_cublas": mismatch,
                   "best_split": best,
                   "best_split_saves_us": (timed["cublas"] - splits[best])
                   if best and "cublas" in timed else None}  # fmt: skip
            results.append(row)
            print(json.dumps(row), flush=True)
        del weights
    torch.cuda.empty_cache()
    return results
