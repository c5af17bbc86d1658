"""`ember bench tune --sustained`: the ceilings and a decode step's two halves, held at the
power limit.

Batch 256's step runs at the card's power limit with its SM clock held down (eighth session,
bench/results/README.md), while the roofline's bf16 peak comes from a burst at full clock. This
holds each workload for seconds, replayed from a CUDA graph, and reads its rate and power
(`ember.bench.roofline.sustained_rate`, `ember.bench.gpu_power`):

- ``bf16_flops`` / ``hbm_copy_bytes``: the two ceilings (an 8,192-cube product, a 4 GiB copy);
- ``decode_gemms``: one step's GEMMs at ``rows`` rows as the engine runs them past the skinny
  GEMM (cuBLAS; o and down as split-K halves), 32 layers of distinct weights and the output
  projection, in FLOP/s;
- ``decode_gemm_<name>``: each of those products alone (the output projection's work is one
  product a step, the others' 32);
- ``decode_attention``: one step's decode attention at ``rows`` x ``context`` over 32 layers'
  own caches, in bytes/s of K/V read;
- ``decode_attention_energy_by_tile``: that attention on each of a few decode tiles, its held
  time and energy per step (`attention_energy`).

So the GEMMs' rate can be read against the product's at the same power, and the sum of the two
halves' times against the whole step's.
"""

from __future__ import annotations

import json
from functools import partial

import torch

from ember.bench.gpu_power import open_nvml
from ember.bench.kernel_bench import LLAMA_8B, decode_attention_bytes, decode_inputs
from ember.bench.roofline import SustainedRate, measure_sustained, sustained_rate
from ember.bench.tune import SEQUENCE_LAYERS, linear_shapes, sequence_weights

SUSTAINED_ROWS = 256
SUSTAINED_CONTEXT = 512
SUSTAINED_SECONDS = 3.0


_LAYER_GEMMS = ("qkv", "o", "gate_up", "down")


def decode_gemms(preset: str, rows: int, names=(*_LAYER_GEMMS, "lm_head"), after=None,
                 device: str = "cuda"):  # fmt: skip
    """(``fn``, FLOPs per call): the step's products ``names``, layer after layer, and the
    logits once a step (after the first layer's products, not after the last as in a step).
    ``after(name, layer, out)``, when given, runs after each product with its output, where a
    step runs its attention, norms and activation (their FLOPs are not counted)."""
    from ember.kernels.linear import linear_parts

    shapes = {name: (n, k) for name, n, k in linear_shapes(preset) if name in names}
    layers = {name: SEQUENCE_LAYERS if name in _LAYER_GEMMS else 1 for name in shapes}
    weights = {name: sequence_weights(*shapes[name], layers=layers[name], device=device)
               for name in shapes}  # fmt: skip
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16, device=device)
              for _, k in shapes.values()}  # fmt: skip
    outs = {name: torch.empty(rows, n, dtype=torch.bfloat16, device=device)
            for name, (n, _) in shapes.items()}  # fmt: skip

    def product(name: str, layer: int) -> torch.Tensor:
        x = inputs[shapes[name][1]]
        if name in ("o", "down"):  # split-K halves, as the engine runs them past 64 rows
            return linear_parts(x, weights[name][layer])
        return torch.matmul(x, weights[name][layer].t(), out=outs[name])

    def step() -> None:
        for layer in range(SEQUENCE_LAYERS):
            for name in shapes:
                if layer < layers[name]:
                    out = product(name, layer)
                    if after is not None:
                        after(name, layer, out)

    flops = 2 * rows * sum(layers[name] * n * k for name, (n, k) in shapes.items())
    return step, flops


def decode_attention_layers(rows: int, context: int) -> list[dict]:
    """32 layers' decode inputs at ``rows`` x ``context``, each over its own cache."""
    return [decode_inputs(LLAMA_8B, rows, context, torch.bfloat16) for _ in range(SEQUENCE_LAYERS)]


def attend_one_layer(inputs: dict, out: torch.Tensor, context: int, tile_config=None) -> None:
    """One layer's decode attention over its `decode_inputs`, into ``out``."""
    from ember.kernels.paged_attention import paged_attention

    paged_attention(**inputs, scale=LLAMA_8B.head_dim**-0.5, out=out, max_query_len=1,
                    max_seq_len=context, tile_config=tile_config)  # fmt: skip


def decode_attention(rows: int, context: int, layers: list[dict] | None = None):
    """(``fn(tile_config)``, K/V bytes per call): decode attention over 32 layers' own caches
    (``layers``, else new ones), on ``tile_config`` (None: the kernel's own choice)."""
    layers = layers or decode_attention_layers(rows, context)
    out = torch.empty_like(layers[0]["q"])

    def step(tile_config=None) -> None:
        for inputs in layers:
            attend_one_layer(inputs, out, context, tile_config)

    moved = SEQUENCE_LAYERS * decode_attention_bytes(LLAMA_8B, rows, context, 2)
    return step, moved


def _held_row(rate: SustainedRate, work_per_step: float) -> dict:
    """A held workload's step time at its sustained rate, beside the rate itself."""
    return {"sustained_step_ms": work_per_step / rate.sustained_per_s * 1e3, **rate.as_dict()}


def held_energy(rate: SustainedRate, seconds_per_step: float) -> dict:
    """Joules a step at the held power: from NVML's energy counter and from its sampled power
    (each where read; nothing without NVML)."""
    if rate.power is None:
        return {}
    energy = {"energy_j_per_step": rate.power.mean_w * seconds_per_step}
    if rate.power.sampled_w_median is not None:
        energy["sampled_energy_j_per_step"] = rate.power.sampled_w_median * seconds_per_step
    return energy


# (BLOCK_N, KV_STAGES, num_warps) of decode tiles whose energy per step is compared: at the
# power limit a step's time is its energy over the limit, so a tile that reads the same bytes
# for fewer joules would speed the capped step even at equal speed alone.
ATTENTION_ENERGY_CONFIGS = ((32, 3, 1), (16, 4, 1), (64, 3, 1), (32, 6, 1), (32, 4, 2),
                            (64, 3, 2), (64, 3, 4), (128, 2, 4))  # fmt: skip


def attention_energy(rows: int, context: int, seconds: float, nvml_handle,
                     configs=ATTENTION_ENERGY_CONFIGS) -> dict:  # fmt: skip
    """Decode attention's held rate and energy per step (32 layers) for each tile config."""
    step, moved = decode_attention(rows, context)
    result = {}
    for block_n, stages, warps in configs:
        config = {"BLOCK_M": 16, "BLOCK_Q": 1, "BLOCK_N": block_n, "num_warps": warps,
                  "KV_STAGES": stages}  # fmt: skip
        rate = sustained_rate(partial(step, config), moved, seconds, calls_per_graph=1,
                              nvml_handle=nvml_handle)  # fmt: skip
        row = _held_row(rate, moved)
        row.update(held_energy(rate, row["sustained_step_ms"] / 1e3))
        name = f"n{block_n}_s{stages}_w{warps}"
        result[name] = row
        print(json.dumps({"attention_config": name,
                          "step_ms": row["sustained_step_ms"],
                          "energy_j_per_step": row.get("energy_j_per_step"),
                          "sampled_energy_j_per_step": row.get("sampled_energy_j_per_step")}),
              flush=True)  # fmt: skip
    return result


def bench_sustained(preset: str, rows: int = SUSTAINED_ROWS, context: int = SUSTAINED_CONTEXT,
                    seconds: float = SUSTAINED_SECONDS) -> dict:  # fmt: skip
    """Each workload's burst and sustained rate, with its power over the sustained half."""
    nvml_handle = open_nvml()
    result = {name: rate.as_dict()
              for name, rate in measure_sustained(seconds, nvml_handle=nvml_handle).items()}  # fmt: skip
    torch.cuda.empty_cache()
    workloads = [
        ("decode_gemms", lambda: decode_gemms(preset, rows)),
        ("decode_attention", lambda: decode_attention(rows, context)),
    ]
    for gemm in (*_LAYER_GEMMS, "lm_head"):  # each alone, for where the GEMMs' time goes
        workloads.append((f"decode_gemm_{gemm}", partial(decode_gemms, preset, rows, (gemm,))))
    for name, make in workloads:
        fn, work = make()  # one at a time: their weights and caches are 15 and 17 GB
        rate = sustained_rate(fn, work, seconds, calls_per_graph=1, nvml_handle=nvml_handle)
        result[name] = {"rows": rows, "context": context, "work_per_step": work,
                        **_held_row(rate, work)}  # fmt: skip
        del fn
        torch.cuda.empty_cache()
    result["decode_attention_energy_by_tile"] = attention_energy(rows, context, seconds,
                                                                 nvml_handle)  # fmt: skip
    torch.cuda.empty_cache()
    return result
