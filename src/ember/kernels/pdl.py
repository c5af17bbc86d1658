"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step at small batch is ~290 short kernels in a row; each one pays its launch, its
first memory latency and the previous kernel's tail, where only a few SMs still work. Launched
with PDL, a kernel's programs are launched and scheduled while the kernel before it finishes, then
wait for it at ``wait_for_producer``, which also lets the next kernel launch in turn.

A cuBLAS kernel in the chain breaks it, so under PDL q/k/v and gate/up move to the skinny GEMM,
slower than cuBLAS at some sizes. Whether PDL pays is therefore a measured question per step size:
``--programmatic-launch auto`` (the default) launches with PDL only the steps whose row count
(a decode step's batch) is in the device's `KernelTuning.pdl_rows`; ``on`` launches every step
so, ``off`` none. A step A/B of the three modes chooses the rows
(bench/results/README.md, "PDL rows").

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
