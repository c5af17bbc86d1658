"""`ember bench tune`: the sweeps behind the GPU fast path's kernel choices, on this GPU.

Two questions, each answered with times replayed from CUDA graphs with L2 flushed (as the
engine runs its decode steps):

- **GEMMs at decode batch sizes.** For each linear layer of the model's shape (q/k/v, o,
  gate/up, down, the output projection) and each batch M: cuBLAS (``torch.matmul``) against
  ``ember.kernels.skinny_gemm`` over a grid of tile configurations, each as bandwidth over the
  bytes the product must move.
- **Decode attention tiles.** ``paged_attention`` over (batch, context) points for a grid of
  (key tile, pipeline depth, warps) and KV split counts, so the decode tile and the split
  heuristic are checked against the best measured.

The figures pick the defaults in ``ember.kernels``; the sweep is kept runnable so a new GPU or
model shape can be re-measured with one command.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from ember.bench.kernel_bench import (
    LLAMA_8B,
    decode_attention_bytes,
    decode_inputs,
    gpu_seconds,
    measure_hbm_bytes_per_s,
    sequence_seconds,
)
from ember.bench.make_model import PRESETS

GEMM_BATCHES = (1, 4, 8, 16, 32, 64)
# (BLOCK_N, BLOCK_K, STAGES, num_warps); BLOCK_M follows M.
GEMM_CONFIGS = (
    (16, 256, 4, 4),
    (32, 256, 4, 4),
    (64, 256, 4, 4),
    (16, 512, 4, 4),
    (32, 128, 6, 4),
    (32, 512, 3, 4),
    (64, 128, 4, 4),
    (32, 256, 4, 8),
    (64, 256, 3, 8),
    (128, 128, 4, 8),
    (16, 128, 8, 2),
)
ATTENTION_POINTS = ((1, 512), (8, 512), (32, 512), (64, 512), (128, 512), (256, 512),
                    (1, 4096), (8, 4096), (32, 4096))  # fmt: skip
# (BLOCK_N, KV_STAGES, num_warps)
# One-warp programs need no cross-warp reductions in the softmax (fifteenth session's lead: a
# decode program's tile loop is bound by per-tile latency, bench/results/README.md).
ATTENTION_CONFIGS = ((64, 3, 4), (32, 3, 4), (32, 4, 2), (64, 4, 4), (64, 2, 4), (64, 3, 2),
                     (128, 2, 4), (128, 3, 8), (16, 4, 2), (16, 4, 1), (32, 3, 1), (64, 3, 1),
                     (32, 6, 1))  # fmt: skip
ATTENTION_SPLITS = (1, 2, 4, 8, 16, 32)


def linear_shapes(preset: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of every distinct linear layer of a make-model preset."""
    cfg = PRESETS[preset]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    qkv = hidden + 2 * cfg["num_key_value_heads"] * head_dim
    return [
        ("qkv", qkv, hidden),
        ("o", hidden, hidden),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
        ("lm_head", cfg["vocab_size"], hidden),
    ]


def _timed_us(fn) -> float | str:
    """Microseconds of ``fn`` or, when the configuration cannot launch, why."""
    try:
        return gpu_seconds(fn) * 1e6
    except Exception as exc:  # noqa: BLE001 - a tile that does not fit is a result, not a crash
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def skinny_configs(m: int) -> dict[str, dict[str, int]]:
    """The skinny GEMM's swept tile configurations for ``m`` rows, by name."""
    from ember.kernels.skinny_gemm import block_m_for

    return {
        f"n{block_n}_k{block_k}_s{stages}_w{warps}": {
            "BLOCK_M": block_m_for(m), "BLOCK_N": block_n, "BLOCK_K": block_k, "STAGES": stages,
            "num_warps": warps,
        }
        for block_n, block_k, stages, warps in GEMM_CONFIGS
    }  # fmt: skip


def bench_gemms(preset: str, hbm_bytes_per_s: float, batches=GEMM_BATCHES) -> list[dict]:
    from ember.kernels.linear import use_skinny_gemm
    from ember.kernels.skinny_gemm import skinny_gemm

    rows = []
    for name, n, k in linear_shapes(preset):
        weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        for m in batches:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            moved = 2 * (n * k + x.numel() + m * n)
            cublas = _timed_us(partial(torch.matmul, x, weight.t(), out=out))
            triton_us = {
                key: _timed_us(partial(skinny_gemm, x, weight, out=out, config=config))
                for key, config in skinny_configs(m).items()
            }
            timed = {key: us for key, us in triton_us.items() if isinstance(us, float)}
            best = min(timed, key=timed.get) if timed else None
            row = {
                "shape": name, "n": n, "k": k, "m": m, "bytes": moved,
                "roofline_us": moved / hbm_bytes_per_s * 1e6,
                "cublas_us": cublas,
                "cublas_tb_per_s": moved / cublas / 1e6 if isinstance(cublas, float) else None,
                "routed_to_skinny": use_skinny_gemm(m, n, k, weight.dtype, weight.device),
                "default_config_us": _timed_us(partial(skinny_gemm, x, weight, out=out)),
                "best_config": best,
                "best_us": timed.get(best),
                "best_tb_per_s": moved / timed[best] / 1e6 if best else None,
                "triton_us": triton_us,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps({k_: v for k_, v in row.items() if k_ != "triton_us"}), flush=True)
        del weight
    torch.cuda.empty_cache()
    return rows


# Layers of distinct weights in a sequence timing: the 8B model's 32, so the weights of one
# shape (1.6-7.5 GB) dwarf L2 as in the engine's step.
SEQUENCE_LAYERS = 32


def sequence_weights(
    n: int, k: int, layers: int = SEQUENCE_LAYERS, device: str = "cuda"
) -> list[torch.Tensor]:
    """``layers`` distinct random bf16 ``[n, k]`` weights (scaled to keep products near unit
    size) for a sequence timing, so no layer finds its weight in L2."""
    return [torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5 for _ in range(layers)]


def _norm_then(norm_in, norm_weight, normed, gemm, layer: int) -> None:
    """One layer of a sequence timing: the RMSNorm kernel that precedes q/k/v and gate/up in a
    decode step, then ``gemm(layer)``; ``gemm`` None times the norm alone."""
    from ember.kernels.rmsnorm import rms_norm

    rms_norm(norm_in, norm_weight, 1e-5, out=normed)
    if gemm is not None:
        gemm(layer)


def sequence_us(layer_fn) -> float | str:
    try:
        return sequence_seconds(layer_fn, SEQUENCE_LAYERS) * 1e6
    except Exception as exc:  # noqa: BLE001 - a tile that does not fit is a result, not a crash
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def bench_gemms_in_sequence(
    preset: str, batches=GEMM_BATCHES, shapes=("qkv", "gate_up")
) -> list[dict]:
    """q/k/v and gate/up as a decode step runs them: after an RMSNorm launch, one layer after
    another with distinct weights, replayed from one graph (`sequence_seconds`). cuBLAS against
    the skinny GEMM's default and swept tiles; ``gemm_us`` is each layer's time less the norm's
    alone, ``layer_us`` the two together."""
    dims = {name: (n, k) for name, n, k in linear_shapes(preset)}
    rows = []
    for name in shapes:
        n, k = dims[name]
        weights = sequence_weights(n, k)
        norm_weight = torch.ones(k, dtype=torch.bfloat16, device="cuda")
        for m in batches:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            normed = torch.empty_like(x)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            layer = partial(_norm_then, x, norm_weight, normed)
            variants = {
                "cublas": partial(_cublas_layer, normed, weights, out),
                "skinny_default": partial(_skinny_layer, normed, weights, out, None),
            }
            for key, config in skinny_configs(m).items():
                variants[key] = partial(_skinny_layer, normed, weights, out, config)
            norm_only = sequence_us(partial(layer, None))
            layer_us = {key: sequence_us(partial(layer, gemm)) for key, gemm in variants.items()}
            gemm_us = {
                key: us - norm_only
                for key, us in layer_us.items()
                if isinstance(us, float) and isinstance(norm_only, float)
            }
            skinny = {key: us for key, us in gemm_us.items() if key != "cublas"}
            best = min(skinny, key=skinny.get) if skinny else None
            row = {"shape": name, "n": n, "k": k, "m": m, "norm_us": norm_only,
                   "cublas_gemm_us": gemm_us.get("cublas"), "best_skinny": best,
                   "best_skinny_gemm_us": skinny.get(best), "gemm_us": gemm_us,
                   "layer_us": layer_us}  # fmt: skip
            rows.append(row)
            print(json.dumps({k_: v for k_, v in row.items() if k_ not in ("gemm_us", "layer_us")}),
                  flush=True)  # fmt: skip
        del weights
    torch.cuda.empty_cache()
    return rows


def _cublas_layer(x, weights, out, layer: int) -> None:
    torch.matmul(x, weights[layer].t(), out=out)


def _skinny_layer(x, weights, out, config, layer: int) -> None:
    from ember.kernels.skinny_gemm import skinny_gemm

    skinny_gemm(x, weights[layer], out=out, config=config)


def bench_attention_tiles(hbm_bytes_per_s: float, points=ATTENTION_POINTS) -> list[dict]:
    from ember.kernels.paged_attention import paged_attention

    shape = LLAMA_8B
    scale = shape.head_dim**-0.5
    rows = []
    for batch, context in points:
        inputs = decode_inputs(shape, batch, context, torch.bfloat16)
        out = torch.empty_like(inputs["q"])
        moved = decode_attention_bytes(shape, batch, context, 2)
        times = {}
        for block_n, stages, warps in ATTENTION_CONFIGS:
            config = {"BLOCK_M": 16, "BLOCK_Q": 1, "BLOCK_N": block_n, "num_warps": warps,
                      "KV_STAGES": stages}  # fmt: skip
            for splits in ATTENTION_SPLITS:
                if splits * block_n > context:
                    continue
                times[f"n{block_n}_s{stages}_w{warps}_x{splits}"] = _timed_us(
                    partial(paged_attention, **inputs, scale=scale, out=out, max_query_len=1,
                            max_seq_len=context, num_kv_splits=splits, tile_config=config)
                )  # fmt: skip
        timed = {key: us for key, us in times.items() if isinstance(us, float)}
        best = min(timed, key=timed.get)
        row = {
            "batch": batch, "context": context, "bytes": moved,
            "roofline_us": moved / hbm_bytes_per_s * 1e6,
            "best": best, "best_us": timed[best],
            "best_fraction": moved / hbm_bytes_per_s / (timed[best] * 1e-6),
            # The kernel's own choice of tiles and splits, whatever its defaults are now.
            "default_us": _timed_us(partial(paged_attention, **inputs, scale=scale, out=out,
                                            max_query_len=1, max_seq_len=context)),
            "us": times,
        }  # fmt: skip
        rows.append(row)
        print(json.dumps({k_: v for k_, v in row.items() if k_ != "us"}), flush=True)
        del inputs, out
    torch.cuda.empty_cache()
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b",
                        help="model shape whose linear layers are swept")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--in-sequence", action="store_true",
                        help="also time q/k/v and gate/up as a step runs them: after a norm, "
                        "32 layers of distinct weights in one graph")  # fmt: skip
    parser.add_argument("--stream-k", action="store_true",
                        help="only the stream-K GEMM against cuBLAS at 128 and 256 rows "
                        "(`ember.bench.tune_stream_k`)")  # fmt: skip
    parser.add_argument("--split-k", action="store_true",
                        help="only o and down at 96-256 rows: cuBLAS then the add + norm against "
                        "split-K partial sums the norm reduces (`ember.bench.tune_split_k`)")  # fmt: skip
    parser.add_argument("--sustained", action="store_true",
                        help="only the ceilings and a batch-256 step's GEMMs and attention, each "
                        "held for seconds at the power limit, with NVML's power "
                        "(`ember.bench.tune_sustained`)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("ember bench tune needs a CUDA GPU")
        return 2
    hbm = measure_hbm_bytes_per_s()
    result = {"gpu": torch.cuda.get_device_name(), "preset": args.preset,
              "hbm_copy_tb_per_s": hbm / 1e12}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tune.json"
    if args.sustained:
        from ember.bench.tune_sustained import bench_sustained

        result["sustained"] = bench_sustained(args.preset)
        path.write_text(json.dumps(result, indent=1))
        return 0
    if args.split_k:
        from ember.bench.tune_split_k import bench_split_k

        result["split_k"] = bench_split_k(args.preset)
        path.write_text(json.dumps(result, indent=1))
        return 0
    if args.stream_k:
        from ember.bench.tune_stream_k import (
            bench_stream_k,
            cublas_gate_up_splits,
            cublas_staircase,
        )

        result["cublas_staircase"] = cublas_staircase()
        path.write_text(json.dumps(result, indent=1))
        result["cublas_gate_up_splits"] = cublas_gate_up_splits(args.preset)
        path.write_text(json.dumps(result, indent=1))
        result["stream_k"] = bench_stream_k(args.preset)
        path.write_text(json.dumps(result, indent=1))
        return 0
    if not args.skip_attention:
        result["attention"] = bench_attention_tiles(hbm)
        path.write_text(json.dumps(result, indent=1))
    if args.in_sequence:
        result["gemm_in_sequence"] = bench_gemms_in_sequence(args.preset)
        path.write_text(json.dumps(result, indent=1))
    if not args.skip_gemm:
        result["gemm"] = bench_gemms(args.preset, hbm)
        path.write_text(json.dumps(result, indent=1))
    return 0
