"""One GPU's routing and tile tables for the Triton path, held by each model instance.

Which kernel runs a linear product at which size, at which step sizes the kernels launch with
programmatic dependent launch, and how attention splits and tiles (`AttentionTuning`) are
measured answers, not constants of the kernels; so are the fused MoE's paths and tiles per expert
shape and token count (`MoeTuning`). A model instance builds its `KernelTuning` once
for its device and passes it down to the ops it launches, so two models of different shapes in
one process (or a GPU whose answers differ) each route by their own table. The defaults are the
H200's; each names the command that measures it again (a "step A/B": `ember bench step` on the
baseline and the variant in one device call) and its entry in bench/results/README.md.
Importable without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ember.kernels.attention_plan import AttentionTuning
from ember.kernels.moe_tiles import MoeTuning
from ember.kernels.tuning_files import file_rows, shipped_rows

# The skinny GEMM's largest M: its tiles hold at most this many rows (`ember.kernels.skinny_gemm`).
SKINNY_GEMM_MAX_ROWS = 64


@dataclass(frozen=True)
class LinearRoutes:
    """Where a linear product ``[m, k] x [n, k]^T`` runs (`ember.kernels.linear.LinearRouter`).

    The skinny Triton GEMM takes products up to `skinny_max_rows` that are no wider than their
    input (attention output, MLP down) or much wider (the vocabulary), and the q/k/v-like ones
    (k < n < 4k) up to `skinny_qkv_max_rows`; under PDL every decode-sized product (a cuBLAS
    kernel breaks the launch chain). The gated gate/up product takes the fused skinny kernel
    past `gated_plain_max_rows` with plain launches, the stream-K kernel over `stream_k_rows`.
    `split_k_rows`: products no wider than their input leave `split_k_max_parts` float32
    partial sums (of at least `split_k_min_part_k` columns each) for the next norm to add.
    """

    # Chosen by `ember bench tune --sections gemm`, then a step A/B
    # (bench/results/README.md, "Skinny GEMM routing").
    skinny_max_rows: int = SKINNY_GEMM_MAX_ROWS
    skinny_qkv_max_rows: int = 16
    # Chosen by a step A/B (bench/results/README.md, "Fused gate/up and SiLU").
    gated_plain_max_rows: int = 16
    # Chosen by `ember bench tune --sections stream_k` and a step A/B at 80-144 rows
    # (bench/results/README.md, "Stream-K gate/up rows").
    stream_k_rows: tuple[int, int] = (SKINNY_GEMM_MAX_ROWS + 1, 128)
    # Chosen by `ember bench tune --sections split_k` and a step A/B at 96-256 rows
    # (bench/results/README.md, "Split-K parts").
    split_k_rows: tuple[int, int] = (SKINNY_GEMM_MAX_ROWS + 1, 256)
    split_k_max_parts: int = 2
    split_k_min_part_k: int = 2048
    # Products by an FP8 weight up to this many rows take the skinny kernel (bf16 activations,
    # the weight widened tile by tile); past it the activations are quantized for cuBLASLt's
    # FP8 GEMM. Not yet chosen by a measurement: every decode-sized product.
    fp8_skinny_max_rows: int = SKINNY_GEMM_MAX_ROWS
    # The skinny kernel widens FP8 weight tiles to bf16 with integer and bf16 operations rather
    # than Triton's two conversions (`ember.kernels.fp8_widen`), whose rate on the SM's
    # conversion units is below what the HBM brings (bench/results/README.md, "FP8 widened in
    # PTX"; `--no-fp8-widen-in-registers` turns it off).
    fp8_widen_in_registers: bool = True


@dataclass(frozen=True)
class KernelTuning:
    """A GPU's tables: linear routes, attention's splits and tiles, the fused MoE's paths and
    tiles, the decode step sizes (rows) that launch with PDL under ``--programmatic-launch
    auto``, and the most rows a forward pass runs with deferred RMSNorms (past the skinny GEMM,
    cuBLAS runs both forms alike and the plain one measured faster)."""

    linear: LinearRoutes = field(default_factory=LinearRoutes)
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    # Chosen by `ember bench tune --sections moe` (its heuristics until a shape is measured).
    moe: MoeTuning = field(default_factory=MoeTuning)
    # Chosen by a step A/B of `--programmatic-launch off|on|auto` at batch 1-64
    # (bench/results/README.md, "PDL rows").
    pdl_rows: frozenset[int] = frozenset({1, 2, 4, 8, 16, 48, 64})
    # Chosen by a step A/B of `--separate-norms` (bench/results/README.md, "Deferred norms").
    defer_norms_max_rows: int = SKINNY_GEMM_MAX_ROWS

    @classmethod
    def for_device(
        cls,
        device: torch.device,
        tuning_file: str | None = None,
        fp8_widen_in_registers: bool = True,
    ) -> KernelTuning:
        """The table for ``device``: the H200's, with the device's SM count, and the fused
        MoE's rows measured on this GPU model (shipped with ember), then those of
        ``tuning_file`` (`ember bench tune`'s tune.json; `ember.kernels.tuning_files`);
        ``fp8_widen_in_registers`` sets `LinearRoutes.fp8_widen_in_registers`,
        `AttentionTuning.kv_fp8_widen_in_registers` and `MoeTuning.fp8_widen_in_registers`."""
        attention = AttentionTuning.for_device(device)
        attention = replace(attention, kv_fp8_widen_in_registers=fp8_widen_in_registers)
        gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        rows = shipped_rows(gpu_name) if gpu_name else ()
        if tuning_file is not None:
            rows += file_rows(tuning_file, gpu_name)
        moe = MoeTuning(
            num_sms=attention.num_sms, fp8_widen_in_registers=fp8_widen_in_registers
        ).with_measured(*rows)
        linear = LinearRoutes(fp8_widen_in_registers=fp8_widen_in_registers)
        return cls(linear=linear, attention=attention, moe=moe)
