"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step at small batch is ~290 short kernels in a row; each one pays its launch, its
first memory latency and the previous kernel's tail, where only a few SMs still work. Launched
with PDL, a kernel's programs are launched and scheduled while the kernel before it finishes, then
wait for it at ``wait_for_producer``, which also lets the next kernel launch in turn.

A cuBLAS kernel in the chain breaks it, so under PDL q/k/v and gate/up move to the skinny GEMM,
slower than cuBLAS at some sizes. Whether PDL pays is therefore a measured question per step size:
``--programmatic-launch auto`` (the default) launches with PDL only the steps whose row count
(a decode step's batch) is in `AUTO_PDL_ROWS`; ``on`` launches every step so, ``off`` none.

The rule that keeps this race-free: every kernel launched with PDL calls ``wait_for_producer``
before it reads or writes anything another kernel of the step writes. Completion is transitive (a
kernel ends only after its own wait returned, and lets the next one launch only then), so a chain
of such kernels sees every earlier write, and before its wait a kernel may read what was written
before the kernel ahead of it started: the step's inputs and the KV cache of earlier steps (the
decode attention loads its first K/V tile there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Decode batch sizes (graph buckets) where PDL won or tied in-call A/Bs on an H200 (8B shape)
# once o/down kept one program per SM: per step at context 512, -65 us at batch 1, -25 to -55 at
# 2, -5 at 4, -28 at 8, -200 at 48, -165 at 64; 16 lost 40 us until the decode attention loaded
# its first K/V tile before its wait, then won 230 us. At 4,096-token contexts PDL wins or ties
# at 1, 16, 48 and 64. Left out: 32, which lost 40 us at context 512 and 320 us at 4,096 (it had
# won 30 us at 512 with a K/V preload that cost ~1 ms at 4,096), and every size past the skinny
# GEMM's 64 rows (bench/results/README.md, "One program per SM; PDL where it wins", "Gate/up and
# SiLU in one kernel", "K/V before the wait" and "Segments per sequence").
AUTO_PDL_ROWS = frozenset({1, 2, 4, 8, 16, 48, 64})


def pdl_for_rows(mode: str, rows: int) -> bool:
    """Whether a step of ``rows`` tokens launches its kernels with PDL under ``mode``."""
    return mode == "on" or (mode == "auto" and rows in AUTO_PDL_ROWS)


def supports_programmatic_launch(device: torch.device) -> bool:
    """PDL needs a CUDA GPU of compute capability 9.0 (Hopper) or later."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def wait_for_producer(ENABLED: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible,
    then allow the next one to launch. Compiled out when the kernel is not launched with PDL
    (Triton's interpreter has no grid-dependency control)."""
    if ENABLED:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
